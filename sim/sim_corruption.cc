// Flip faults, which corrupt a payload on its way, and checksums, which
// catch corrupted or modified payloads (see "Faults" in sim.h).
#include <xxhash.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/splitmix64.h"
#include "sim/fault.h"
#include "sim/internal/sim_internal.h"
#include "sim/sim.h"

namespace flatparam {

using internal_sim::HasBuffers;
using internal_sim::JoinCapped;
using internal_sim::KindName;
using internal_sim::OpKind;

std::vector<uint64_t> SimWorld::Checksums(const Call& c, int n, int me) const {
  // Reduce-scatter sends a different chunk to each rank: one hash per
  // destination, so that the receiver of a corrupted chunk can be named.
  if (c.kind == OpKind::kReduceScatter) {
    std::vector<uint64_t> out;
    const int64_t chunk = c.output.bytes();
    for (int j = 0; j < n; ++j) {
      out.push_back(XXH3_64bits(
          static_cast<const char*>(c.input.data) + j * chunk, chunk));
    }
    return out;
  }
  if (c.kind == OpKind::kAllGatherBytes) {
    return {XXH3_64bits(c.bytes.data(), c.bytes.size())};
  }
  if (c.kind == OpKind::kBroadcast && c.root != me) return {};
  if (!HasBuffers(c.kind)) return {};
  return {XXH3_64bits(c.input.data, c.input.bytes())};
}

std::optional<SimWorld::Delivery> SimWorld::PrepareDelivery(Op& op) {
  std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  Delivery d;
  d.kind = ms[0].call.kind;
  d.root = d.kind == OpKind::kBroadcast ? ms[0].call.root : -1;
  d.src.assign(n, nullptr);
  d.payload.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    const Call& c = ms[i].call;
    if (d.kind == OpKind::kAllGatherBytes) {
      d.src[i] = c.bytes.data();
      d.payload[i] = static_cast<int64_t>(c.bytes.size());
    } else if (HasBuffers(d.kind)) {
      d.src[i] = static_cast<const char*>(c.input.data);
      d.payload[i] = c.input.bytes();
    }
  }
  for (int i = 0; i < n; ++i) {
    const FaultSpec* f = ms[i].flip;
    if (f == nullptr) continue;
    // A non-root broadcast member sends nothing: corrupt what it receives.
    const int sender = d.kind == OpKind::kBroadcast ? d.root : i;
    const int64_t bits = d.payload[sender] * 8;
    int64_t bit = f->bit;
    if (bit < 0 && bits > 0) {
      // Drawn from the seed without touching the scheduler's PRNG.
      bit = static_cast<int64_t>(
          SplitMix64(options_.seed ^ SplitMix64(f->rank) ^ SplitMix64(~f->op)) %
          static_cast<uint64_t>(bits));
    }
    if (bit < 0 || bit >= bits) {
      FailOp(op, absl::StatusCode::kFailedPrecondition,
             absl::StrFormat(
                 "fault %s cannot apply: rank %d's payload in this operation "
                 "(%s #%d) has %d bits; a flip needs an op whose payload is "
                 "not empty (not a barrier, a split, or a collective of count "
                 "0, such as the conformance suite's first cases) and a bit "
                 "below its size: --trace shows what each op number is",
                 f->ToString(), ms[sender].world_rank, KindName(d.kind), op.seq,
                 bits));
      return std::nullopt;
    }
    d.flipped.assign(d.src[sender], d.src[sender] + d.payload[sender]);
    d.flipped[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    d.flip_member = i;
    break;
  }
  return d;
}

std::string SimWorld::VerifyChecksums(const Op& op, const Delivery& d) const {
  const std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  std::string corruption;
  for (int i = 0; i < n; ++i) {
    if (ms[i].sent_hashes.empty()) continue;
    std::vector<int> receivers;
    uint64_t sent = 0, got = 0;
    auto check = [&](uint64_t want, const char* data, int64_t bytes,
                     int receiver) {
      const uint64_t h = XXH3_64bits(data, bytes);
      if (h == want) return;
      if (receivers.empty()) {
        sent = want;
        got = h;
      }
      receivers.push_back(ms[receiver].world_rank);
    };
    if (d.kind == OpKind::kReduceScatter) {
      // Chunk j of the sender's input goes to rank j.
      const int64_t chunk = ms[i].call.output.bytes();
      for (int j = 0; j < n; ++j) {
        check(ms[i].sent_hashes[j], d.Contribution(i) + j * chunk, chunk, j);
      }
    } else {
      for (int j = 0; j < n; ++j) {
        if (j != i)
          check(ms[i].sent_hashes[0], d.Source(i, j), d.payload[i], j);
      }
    }
    if (receivers.empty()) continue;
    absl::StrAppendFormat(
        &corruption,
        "%sdata sent by rank %d (its op %d) failed its checksum at rank%s %s "
        "(xxh3 %016x when sent, %016x when delivered)",
        corruption.empty() ? "" : "; ", ms[i].world_rank, ms[i].rank_op,
        receivers.size() == 1 ? "" : "s", JoinCapped(receivers, 8), sent, got);
  }
  return corruption;
}

}  // namespace flatparam
