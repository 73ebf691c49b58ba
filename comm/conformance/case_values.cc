#include "comm/conformance/case_values.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/host_reduce.h"
#include "flatparam/base/splitmix64.h"

namespace flatparam {
namespace conformance {
namespace {

// Inputs of different kinds differ, so that a backend that mixes up
// collectives cannot pass by accident.
int Salt(CollectiveKind kind) { return static_cast<int>(kind) + 1; }

bool IsPowerOfTwo(double x) {
  if (!(x > 0) || !std::isfinite(x)) return false;
  int exponent = 0;
  return std::frexp(x, &exponent) == 0.5;
}

// kExact value of element `g` of rank `rank`'s input.
double ExactValue(int salt, int rank, int64_t g) {
  return static_cast<double>(
             (7 * (g % kExactPeriod) + rank % kExactPeriod + salt) %
             kExactPeriod) -
         4;
}

// kInexact value: a full mantissa, a random sign and an exponent in
// [-4, 3], so that sums of a few of them round in every dtype.
double InexactValue(int salt, int rank, int64_t g) {
  const uint64_t h =
      SplitMix64(SplitMix64(static_cast<uint64_t>(rank) * 1000003u + salt) ^
                 static_cast<uint64_t>(g));
  const double mantissa =
      1.0 + static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
  const int exponent = static_cast<int>((h >> 1) % 8) - 4;
  return std::ldexp((h & 1) ? -mantissa : mantissa, exponent);
}

// Tiles `pattern` (kExactPeriod elements, element j standing for indices
// g with g % kExactPeriod == j) over elements [first, first + out.count).
void TilePeriod(const HostBuffer& pattern, int64_t first, BufferRef out) {
  const size_t size = DTypeSize(out.dtype);
  const char* p = static_cast<const char*>(pattern.data());
  char* o = static_cast<char*>(out.data);
  // One period starting at `first`'s phase, then doubling copies.
  const int64_t head = std::min<int64_t>(kExactPeriod, out.count);
  for (int64_t i = 0; i < head; ++i) {
    std::memcpy(o + i * size, p + ((first + i) % kExactPeriod) * size, size);
  }
  int64_t filled = head;
  while (filled < out.count) {
    // Copy whole periods so the phase is kept.
    const int64_t periods = filled / kExactPeriod;
    const int64_t chunk =
        std::min<int64_t>(periods * kExactPeriod, out.count - filled);
    std::memcpy(o + filled * size, o, static_cast<size_t>(chunk) * size);
    filled += chunk;
  }
}

// The reduction over `n` ranks of elements [first, first + count) of their
// inputs.
HostBuffer ExpectedReduction(const CollectiveCase& c, int n, int64_t first,
                             int64_t count) {
  HostBuffer out(c.dtype, count);
  if (count == 0) return out;
  const ReduceOptions options = c.reduce_options();
  const bool periodic = c.values == Values::kExact && count > kExactPeriod;
  const int64_t first_in = periodic ? 0 : first;
  const int64_t count_in = periodic ? kExactPeriod : count;
  std::vector<HostBuffer> inputs;
  inputs.reserve(n);
  std::vector<const void*> pointers;
  for (int r = 0; r < n; ++r) {
    inputs.emplace_back(c.dtype, count_in);
    FillInput(c, r, first_in, inputs.back().ref());
    pointers.push_back(inputs.back().data());
  }
  if (!periodic) {
    HostReduce(pointers, out.data(), count, c.dtype, options, n);
    return out;
  }
  HostBuffer period(c.dtype, kExactPeriod);
  HostReduce(pointers, period.data(), kExactPeriod, c.dtype, options, n);
  TilePeriod(period, first, out.ref());
  return out;
}

std::string Factor(absl::string_view name, double value) {
  return value == 1.0 ? "" : absl::StrFormat(" %s %g", name, value);
}

}  // namespace

absl::string_view ValuesName(Values values) {
  return values == Values::kExact ? "exact" : "inexact";
}

int64_t CollectiveCase::input_count(int n) const {
  return kind == CollectiveKind::kReduceScatter ? n * count : count;
}

int64_t CollectiveCase::output_count(int n) const {
  return kind == CollectiveKind::kAllGather ? n * count : count;
}

ReduceOptions CollectiveCase::reduce_options() const {
  ReduceOptions options;
  options.op = op;
  options.pre_divide_factor = pre_divide_factor;
  options.post_divide_factor = post_divide_factor;
  return options;
}

std::string CollectiveCase::Name() const {
  std::string name = absl::StrFormat("%s %s count %d", CollectiveKindName(kind),
                                     DTypeName(dtype), count);
  if (kind == CollectiveKind::kReduceScatter ||
      kind == CollectiveKind::kAllReduce) {
    absl::StrAppend(&name, " ", ReduceOpName(op),
                    Factor("pre", pre_divide_factor),
                    Factor("post", post_divide_factor));
  }
  if (kind == CollectiveKind::kBroadcast)
    absl::StrAppend(&name, " root ", root);
  absl::StrAppend(&name, " ", ValuesName(values));
  if (in_place && kind != CollectiveKind::kBroadcast) {
    absl::StrAppend(&name, " in place");
  }
  return name;
}

bool IsOrderIndependent(const CollectiveCase& c, int n) {
  if (c.kind == CollectiveKind::kAllGather ||
      c.kind == CollectiveKind::kBroadcast) {
    return true;
  }
  // Max and min pick one of their inputs: no rounding, whatever the order.
  if (c.op == ReduceOp::kMax || c.op == ReduceOp::kMin) return true;
  return c.values == Values::kExact && n <= kMaxExactGroup &&
         IsPowerOfTwo(c.pre_divide_factor) &&
         IsPowerOfTwo(c.post_divide_factor) &&
         (c.op != ReduceOp::kAvg || IsPowerOfTwo(n));
}

void FillInput(const CollectiveCase& c, int rank, int64_t first,
               BufferRef host) {
  assert(host.dtype == c.dtype);
  const int salt = Salt(c.kind);
  if (c.values == Values::kExact) {
    HostBuffer pattern(c.dtype, kExactPeriod);
    for (int j = 0; j < kExactPeriod; ++j) {
      StoreFromDouble(pattern.data(), c.dtype, j, ExactValue(salt, rank, j));
    }
    TilePeriod(pattern, first, host);
    return;
  }
  for (int64_t i = 0; i < host.count; ++i) {
    StoreFromDouble(host.data, host.dtype, i,
                    InexactValue(salt, rank, first + i));
  }
}

HostBuffer ExpectedOutput(const CollectiveCase& c, int n, int rank) {
  const int64_t count = c.count;
  switch (c.kind) {
    case CollectiveKind::kAllGather: {
      HostBuffer out(c.dtype, n * count);
      for (int r = 0; r < n; ++r) {
        FillInput(c, r, 0, out.ref().Slice(r * count, count));
      }
      return out;
    }
    case CollectiveKind::kBroadcast: {
      HostBuffer out(c.dtype, count);
      FillInput(c, c.root, 0, out.ref());
      return out;
    }
    case CollectiveKind::kReduceScatter:
      return ExpectedReduction(c, n, rank * count, count);
    case CollectiveKind::kAllReduce:
      return ExpectedReduction(c, n, 0, count);
  }
  return HostBuffer(c.dtype, 0);
}

int64_t CountMismatches(const void* got, const void* want, int64_t count,
                        DType dtype, int64_t* first) {
  *first = -1;
  const size_t size = DTypeSize(dtype);
  if (count == 0 ||
      std::memcmp(got, want, static_cast<size_t>(count) * size) == 0) {
    return 0;
  }
  const char* g = static_cast<const char*>(got);
  const char* w = static_cast<const char*>(want);
  int64_t wrong = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (std::memcmp(g + i * size, w + i * size, size) == 0) continue;
    if (wrong++ == 0) *first = i;
  }
  return wrong;
}

std::string DescribeMismatch(const void* got, const void* want, DType dtype,
                             int64_t index) {
  const size_t size = DTypeSize(dtype);
  auto bits = [&](const void* data) {
    uint64_t b = 0;
    std::memcpy(&b, static_cast<const char*>(data) + index * size, size);
    return absl::StrFormat("0x%0*x", static_cast<int>(2 * size), b);
  };
  return absl::StrFormat(
      "element %d is %.17g (bits %s), expected %.17g "
      "(bits %s)",
      index, LoadAsDouble(got, dtype, index), bits(got),
      LoadAsDouble(want, dtype, index), bits(want));
}

}  // namespace conformance
}  // namespace flatparam
