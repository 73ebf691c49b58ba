// LibTorch's C++ API headers that flatparam/torch, the LibTorch GPT and
// their tests include, precompiled once per build configuration
// (`:libtorch_pch` in this package's BUILD file, tools/bazel/pch.bzl): each
// of those files spent about half of its compile time (6 of 12 s for
// fsdp_module_hooks.cc) parsing them again.
//
// Only the build includes this header (-include, where
// --//tools/bazel:precompiled_headers is on; .bazelrc turns it on). Every
// file still includes what it uses, so that it compiles without it: the kit's
// CMake build, tools/libtorch_headers_check.py and a consumer of @flatparam
// compile these files with no precompiled header.
#ifndef FLATPARAM_TORCH_INTERNAL_LIBTORCH_PCH_H_
#define FLATPARAM_TORCH_INTERNAL_LIBTORCH_PCH_H_

#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#endif  // FLATPARAM_TORCH_INTERNAL_LIBTORCH_PCH_H_
