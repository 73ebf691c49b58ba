// splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", 2014; Vigna's public-domain C reference): a 64-bit mixing
// function with a fixed, documented definition, for values that tests,
// the simulator and generated checkpoints derive from seeds and indices.
// Not for anything that needs unpredictability.
//
//   const uint64_t h = SplitMix64(SplitMix64(seed) ^ index);
//   uint64_t state = seed;
//   const uint64_t a = SplitMix64Next(&state), b = SplitMix64Next(&state);
//
// Thread-safety: pure functions.
#ifndef FLATPARAM_BASE_SPLITMIX64_H_
#define FLATPARAM_BASE_SPLITMIX64_H_

#include <cstdint>

namespace flatparam {

// The generator's increment (2^64 / the golden ratio).
inline constexpr uint64_t kSplitMix64Increment = 0x9e3779b97f4a7c15ULL;

// splitmix64's output function applied to `x + kSplitMix64Increment`.
constexpr uint64_t SplitMix64(uint64_t x) {
  x += kSplitMix64Increment;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The generator: the next output of the sequence at `*state`, which
// advances by kSplitMix64Increment.
constexpr uint64_t SplitMix64Next(uint64_t* state) {
  const uint64_t out = SplitMix64(*state);
  *state += kSplitMix64Increment;
  return out;
}

}  // namespace flatparam

#endif  // FLATPARAM_BASE_SPLITMIX64_H_
