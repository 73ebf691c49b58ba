#include "refmodel/synthetic_step.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace refmodel {
namespace {

std::string UnitName(const FsdpRuntime& rt, int unit) {
  const std::string& name = rt.layout().flat_params()[unit].unit();
  return name.empty() ? std::string("root") : name;
}

}  // namespace

absl::StatusOr<std::vector<absl::Duration>> SyntheticForwardTimes(
    const ModelLayout& layout, double tokens_per_rank,
    double flops_per_second) {
  if (!(tokens_per_rank > 0) || !std::isfinite(tokens_per_rank) ||
      !(flops_per_second > 0) || !std::isfinite(flops_per_second)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "synthetic step: tokens per rank (%g) and FLOP/s (%g) must be "
        "positive and finite",
        tokens_per_rank, flops_per_second));
  }
  std::vector<absl::Duration> out;
  for (const FlatParamLayout& l : layout.flat_params()) {
    out.push_back(absl::Seconds(2.0 * static_cast<double>(l.param_numel()) *
                                tokens_per_rank / flops_per_second));
  }
  return out;
}

absl::Status RunSyntheticStep(FsdpRuntime& rt,
                              const std::vector<absl::Duration>& forward,
                              const KernelFn& kernel, bool blocking_reductions,
                              const std::vector<int>& skipped_units) {
  const int n = rt.num_units();
  if (rt.root_unit() != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "synthetic step: unit 0 must be the root (module prefix \"\"), as "
        "fsdp plan assumes; it is \"%s\"",
        rt.layout().flat_params()[0].unit()));
  }
  if (static_cast<int>(forward.size()) != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "synthetic step: %d forward times for %d units", forward.size(), n));
  }
  auto run = [&](int u, bool backward, absl::Duration d,
                 absl::string_view suffix) {
    KernelCall call;
    call.name = absl::StrCat(backward ? "backward " : "forward ",
                             UnitName(rt, u), suffix);
    call.unit = u;
    call.backward = backward;
    call.duration = d;
    call.handle = &rt.handle(u);
    return kernel(call);
  };
  const absl::Duration root_half = forward[0] / 2;
  FLATPARAM_RETURN_IF_ERROR(rt.PreForward(0));
  FLATPARAM_RETURN_IF_ERROR(run(0, false, root_half, " (before layers)"));
  std::vector<char> skip(n, 0);
  for (int u : skipped_units) {
    if (u < 1 || u >= n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "synthetic step: skipped unit %d is not a layer (1..%d)", u, n - 1));
    }
    skip[u] = 1;
  }
  for (int u = 1; u < n; ++u) {
    if (skip[u]) continue;
    FLATPARAM_RETURN_IF_ERROR(rt.PreForward(u));
    FLATPARAM_RETURN_IF_ERROR(run(u, false, forward[u], ""));
    FLATPARAM_RETURN_IF_ERROR(rt.PostForward(u));
  }
  FLATPARAM_RETURN_IF_ERROR(run(0, false, root_half, " (after layers)"));
  FLATPARAM_RETURN_IF_ERROR(rt.PostForward(0));
  FLATPARAM_RETURN_IF_ERROR(rt.PreBackward(0));
  FLATPARAM_RETURN_IF_ERROR(run(0, true, 2 * root_half, " (after layers)"));
  for (int u = n - 1; u >= 1; --u) {
    if (skip[u]) continue;
    FLATPARAM_RETURN_IF_ERROR(rt.PreBackward(u));
    FLATPARAM_RETURN_IF_ERROR(run(u, true, 2 * forward[u], ""));
    FLATPARAM_RETURN_IF_ERROR(rt.PostBackward(u));
    if (blocking_reductions) {
      FLATPARAM_RETURN_IF_ERROR(rt.handle(u).FinishReduceGrad());
    }
  }
  FLATPARAM_RETURN_IF_ERROR(run(0, true, 2 * root_half, " (before layers)"));
  FLATPARAM_RETURN_IF_ERROR(rt.PostBackward(0));
  if (blocking_reductions) {
    FLATPARAM_RETURN_IF_ERROR(rt.handle(0).FinishReduceGrad());
  }
  return rt.FinalizeBackward();
}

absl::Status SpinKernel(const KernelCall& call) {
  const absl::Time end = absl::Now() + call.duration;
  while (absl::Now() < end) {
  }
  return absl::OkStatus();
}

}  // namespace refmodel
}  // namespace flatparam
