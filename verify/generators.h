// Named RapidCheck generators for flat-parameter layouts, sharding and model
// wrapping, shared by the property suites in verify/ (test-only).
//
// Every generator is named with `.as("...")`, so a counterexample prints as
// e.g. `param specs (data-sized): [{fqn="layers.1.w", shape=[3, 5], ...}]`,
// and the types below have `showValue` overloads for readable output.
//
// Sizes come in two scales:
//   * Scale::kMetadata: per-parameter numels up to 2^36 and totals up to about
//     2^40. Use it only for properties that touch metadata (FlatParamLayout,
//     ModelLayout); nothing may allocate per element there.
//   * Scale::kData: the sum of all parameter numels stays <= kMaxDataNumel,
//     for properties that allocate and move parameter data.
// Both scales include 0-d scalars, zero-size dimensions and tiny tensors.
//
// Example:
//
//   RC_GTEST_PROP(Layout, Foo, ()) {
//     const auto specs = *verify::GenParamSpecs(verify::Scale::kData);
//     const auto options = *verify::GenLayoutOptions();
//     ...
//   }
//
// Generators are values (cheap to copy) and hold no state between calls;
// like all of RapidCheck they must be used from the thread running the
// property.
#ifndef FLATPARAM_VERIFY_GENERATORS_H_
#define FLATPARAM_VERIFY_GENERATORS_H_

#include <rapidcheck.h>

#include <cstdint>
#include <ostream>
#include <vector>

#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {

// Pretty-printers RapidCheck finds by argument-dependent lookup.
void showValue(DType dtype, std::ostream& os);
void showValue(ShardingStrategy strategy, std::ostream& os);
void showValue(const ParamSpec& spec, std::ostream& os);
void showValue(const LayoutOptions& options, std::ostream& os);
void showValue(const ModelSpec& spec, std::ostream& os);
void showValue(const ShardInterval& interval, std::ostream& os);
void showValue(const ShardParamInfo& info, std::ostream& os);

namespace verify {

enum class Scale { kData, kMetadata };

// At most this many parameters per generated list or model.
inline constexpr int kMaxParams = 24;
// Upper bounds on one parameter's numel, per scale.
inline constexpr int64_t kMaxDataParamNumel = 800;
inline constexpr int64_t kMaxMetadataParamNumel = int64_t{1} << 36;
// Upper bound on the summed numel of a data-sized list or model.
inline constexpr int64_t kMaxDataNumel = kMaxParams * kMaxDataParamNumel;
// World sizes range over [1, kMaxWorldSize].
inline constexpr int64_t kMaxWorldSize = 4096;

// `rc::gen::inRange` without its dependence on the generation size: values
// span the whole of [min, max) from the first test case on (inRange confines
// them to a prefix that grows with the size), and still shrink towards min.
template <typename T>
rc::Gen<T> UniformInRange(T min, T max) {
  return rc::gen::resize(100, rc::gen::inRange<T>(min, max));
}

// The four flattenable dtypes: float32, float64, float16, bfloat16.
rc::Gen<DType> GenDType();

// Integer and bool dtypes, which FlatParamLayout rejects.
rc::Gen<DType> GenNonFloatingDType();

// World sizes in [1, 4096], biased towards 1..8, powers of two and primes
// (including 4093, the largest prime below 4096).
rc::Gen<int64_t> GenWorldSize();

// All five sharding strategies, FULL_SHARD most often.
rc::Gen<ShardingStrategy> GenShardingStrategy();

// Shapes: 0-d scalars, shapes with a zero-size dimension, tiny tensors (1..8
// elements) and ordinary tensors of rank 1..4 up to the scale's per-parameter
// numel bound.
rc::Gen<std::vector<int64_t>> GenShape(Scale scale = Scale::kMetadata);

// 1..kMaxParams parameters of dtype `dtype` with unique module-like fqns
// ("layers.10.attn.w"), mostly requires_grad, and about one in five tied
// (`tied_to`) to an earlier parameter, itself tied or not. A tied parameter
// has its primary's shape and dtype. At metadata scale a third of the lists
// are data-sized throughout, so that world sizes often exceed the numel. The
// list may have zero total numel (every parameter zero-size), which
// FlatParamLayout rejects.
rc::Gen<std::vector<ParamSpec>> GenParamSpecs(DType dtype, Scale scale);
// The same with the dtype drawn from GenDType().
rc::Gen<std::vector<ParamSpec>> GenParamSpecs(Scale scale = Scale::kMetadata);

// World size from GenWorldSize(), any strategy, alignment on or off, and
// sometimes a (floating) compute dtype that differs from the parameters'.
rc::Gen<LayoutOptions> GenLayoutOptions();

// A model of one dtype: 1..kMaxParams parameters in module pre-order with
// module paths up to three deep (names include "1" and "10", "attn" and
// "attn_norm", so string prefixes that are not module prefixes occur),
// 0..6 wrap prefixes naming modules that hold parameters, and ties only
// between parameters of the same unit. A unit may still end up with zero
// total numel, which ModelLayout rejects.
rc::Gen<ModelSpec> GenModelSpec(Scale scale = Scale::kMetadata);

// PyTorch needs uniform `requires_grad` within a flat parameter unless
// use_orig_params (the aligned layouts here): without `align_addresses`,
// every parameter of a unit takes the flag of the unit's first parameter.
// Generated specs mix the flags freely; tests pairing them with drawn
// options call these so that unaligned draws stay valid.
void FitRequiresGrad(const LayoutOptions& options,
                     std::vector<ParamSpec>* specs);
void FitRequiresGrad(const LayoutOptions& options, ModelSpec* spec);

// Sum of the numels of the parameters that are not tied.
int64_t UntiedNumel(absl::Span<const ParamSpec> specs);

}  // namespace verify
}  // namespace flatparam

#endif  // FLATPARAM_VERIFY_GENERATORS_H_
