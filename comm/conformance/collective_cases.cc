#include "comm/conformance/collective_cases.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace conformance {
namespace {

// Garbage that is not zero, so that a missing write shows.
constexpr int kScribble = 0x5A;

CollectiveOptions Timed(absl::Duration timeout) {
  CollectiveOptions options;
  options.timeout = timeout;
  return options;
}

ReduceOptions Timed(ReduceOptions options, absl::Duration timeout) {
  options.timeout = timeout;
  return options;
}

std::string Prefix(const Communicator& comm, absl::string_view name) {
  return absl::StrFormat("rank %d of %d: %s", comm.rank(), comm.size(), name);
}

struct Reduction {
  ReduceOp op;
  double pre;
  double post;
};

// Power-of-two factors are exact; 3 and 7 make the divisions round.
constexpr Reduction kReductions[] = {
    {ReduceOp::kSum, 1, 1}, {ReduceOp::kAvg, 1, 1}, {ReduceOp::kMax, 1, 1},
    {ReduceOp::kMin, 1, 1}, {ReduceOp::kSum, 2, 4}, {ReduceOp::kAvg, 4, 2},
    {ReduceOp::kAvg, 3, 7},
};

// The buffers of one case on one rank, ready to issue.
struct Prepared {
  DeviceBuffer input;   // empty when in place (or a broadcast)
  DeviceBuffer output;  // empty for in-place reductions
  ConstBufferRef input_ref;
  BufferRef output_ref;
};

absl::StatusOr<Prepared> Prepare(const CollectiveCase& c, int n, int me,
                                 DeviceMemory& memory) {
  Prepared p;
  const int64_t in_count = c.input_count(n);
  const int64_t out_count = c.output_count(n);
  // Freed before the collective runs: large cases need not keep a host copy
  // alive on every rank at once.
  HostBuffer host(c.dtype, in_count);
  FillInput(c, me, 0, host.ref());
  auto alloc = [&](int64_t count) {
    return DeviceBuffer::Allocate(memory, c.dtype, count);
  };
  switch (c.kind) {
    case CollectiveKind::kAllGather: {
      FLATPARAM_ASSIGN_OR_RETURN(p.output, alloc(out_count));
      FLATPARAM_RETURN_IF_ERROR(p.output.Fill(kScribble));
      p.output_ref = p.output.ref();
      if (c.in_place) {
        FLATPARAM_RETURN_IF_ERROR(p.output.Upload(host, me * c.count));
        p.input_ref = p.output_ref.Slice(me * c.count, c.count);
      } else {
        FLATPARAM_ASSIGN_OR_RETURN(p.input, alloc(in_count));
        FLATPARAM_RETURN_IF_ERROR(p.input.Upload(host));
        p.input_ref = p.input.ref();
      }
      break;
    }
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce: {
      FLATPARAM_ASSIGN_OR_RETURN(p.input, alloc(in_count));
      FLATPARAM_RETURN_IF_ERROR(p.input.Upload(host));
      p.input_ref = p.input.ref();
      if (c.in_place) {
        p.output_ref = c.kind == CollectiveKind::kReduceScatter
                           ? p.input.ref().Slice(me * c.count, c.count)
                           : p.input.ref();
        // The input is the output: nothing to compare it with afterwards.
        p.output = std::move(p.input);
        p.input = DeviceBuffer();
      } else {
        FLATPARAM_ASSIGN_OR_RETURN(p.output, alloc(out_count));
        FLATPARAM_RETURN_IF_ERROR(p.output.Fill(kScribble));
        p.output_ref = p.output.ref();
      }
      break;
    }
    case CollectiveKind::kBroadcast: {
      FLATPARAM_ASSIGN_OR_RETURN(p.output, alloc(out_count));
      if (me == c.root) {
        FLATPARAM_RETURN_IF_ERROR(p.output.Upload(host));
      } else {
        FLATPARAM_RETURN_IF_ERROR(p.output.Fill(kScribble));
      }
      p.output_ref = p.output.ref();
      p.input_ref = p.output_ref;
      break;
    }
  }
  return p;
}

absl::Status Issue(Communicator& comm, const CollectiveCase& c,
                   const Prepared& p, absl::Duration timeout) {
  switch (c.kind) {
    case CollectiveKind::kAllGather:
      return comm.AllGather(p.input_ref, p.output_ref, Timed(timeout))->Wait();
    case CollectiveKind::kReduceScatter:
      return comm
          .ReduceScatter(p.input_ref, p.output_ref,
                         Timed(c.reduce_options(), timeout))
          ->Wait();
    case CollectiveKind::kAllReduce:
      return comm
          .AllReduce(p.input_ref, p.output_ref,
                     Timed(c.reduce_options(), timeout))
          ->Wait();
    case CollectiveKind::kBroadcast: {
      BroadcastOptions options;
      options.timeout = timeout;
      options.root = c.root;
      return comm.Broadcast(p.output_ref, options)->Wait();
    }
  }
  return absl::InternalError("unknown collective kind");
}

// Records the first failed expectation of a group check and goes on, so
// that every rank makes the same collectives.
class Checker {
 public:
  Checker(const Communicator& comm, absl::string_view name)
      : prefix_(Prefix(comm, name)) {}

  void Expect(bool ok, absl::string_view what) {
    if (!ok && result_.status.ok()) {
      result_.status = absl::InternalError(absl::StrCat(prefix_, ": ", what));
    }
  }

  // A collective or setup step that must succeed; false if it did not.
  bool Ok(const absl::Status& status, absl::string_view what) {
    if (status.ok()) return true;
    if (result_.status.ok()) {
      result_.status = absl::Status(
          status.code(),
          absl::StrCat(prefix_, ": ", what, ": ", status.ToString()));
    }
    result_.collective_error = true;
    return false;
  }

  // A call that must fail with `code` and a message containing every one
  // of `substrings`.
  void ExpectError(const absl::Status& status, absl::StatusCode code,
                   std::initializer_list<std::string> substrings,
                   absl::string_view what) {
    bool ok = status.code() == code;
    for (const std::string& s : substrings) {
      ok = ok && absl::StrContains(status.message(), s);
    }
    if (!ok) {
      Expect(false,
             absl::StrFormat("%s: got %s, want code %s with \"%s\"", what,
                             status.ToString(), absl::StatusCodeToString(code),
                             absl::StrJoin(substrings, "\", \"")));
    }
  }

  bool failed() const { return !result_.status.ok(); }
  CaseResult result() const { return result_; }

 private:
  std::string prefix_;
  CaseResult result_;
};

// The members of `group` as world ranks, gathered through the group itself.
std::vector<std::string> GatherRanks(Checker& check, Communicator& group,
                                     int world_rank, absl::Duration timeout) {
  absl::StatusOr<std::vector<std::string>> ranks =
      group.AllGatherBytes(absl::StrCat(world_rank), Timed(timeout));
  if (!check.Ok(ranks.status(), "all_gather_bytes of the members")) return {};
  return *ranks;
}

std::vector<std::string> ToStrings(const std::vector<int>& ranks) {
  std::vector<std::string> out;
  for (int r : ranks) out.push_back(absl::StrCat(r));
  return out;
}

// Sums (world rank + 1) over `group` with an all_reduce on `memory` and
// checks it against `members`.
void ExpectGroupSum(Checker& check, Communicator& group, DeviceMemory& memory,
                    int world_rank, const std::vector<int>& members,
                    absl::Duration timeout) {
  HostBuffer value(DType::kFloat32, 1);
  StoreFromDouble(value.data(), DType::kFloat32, 0, world_rank + 1);
  absl::StatusOr<DeviceBuffer> buffer =
      DeviceBuffer::Allocate(memory, DType::kFloat32, 1);
  if (!check.Ok(buffer.status(), "allocating")) return;
  if (!check.Ok(buffer->Upload(value), "uploading")) return;
  const absl::Status status =
      group.AllReduce(buffer->ref(), buffer->ref(), Timed({}, timeout))->Wait();
  if (!check.Ok(status, "all_reduce of (world rank + 1)")) return;
  std::vector<char> storage;
  absl::StatusOr<const void*> got = ReadBack(memory, buffer->ref(), storage);
  if (!check.Ok(got.status(), "reading back")) return;
  double want = 0;
  for (int m : members) want += m + 1;
  const double sum = LoadAsDouble(*got, DType::kFloat32, 0);
  check.Expect(sum == want, absl::StrFormat("sum of (world rank + 1) over "
                                            "the group is %g, expected %g",
                                            sum, want));
}

// The number after `marker` in `message` ("all_gather #12: ..." -> 12), or
// -1 if there is none.
int64_t SequenceNumber(absl::string_view message, absl::string_view marker) {
  const size_t at = message.find(marker);
  if (at == absl::string_view::npos) return -1;
  absl::string_view digits = message.substr(at + marker.size());
  size_t n = 0;
  while (n < digits.size() && digits[n] >= '0' && digits[n] <= '9') ++n;
  int64_t seq = -1;
  return absl::SimpleAtoi(digits.substr(0, n), &seq) ? seq : -1;
}

CaseResult CheckExactReductions(Communicator& comm, DeviceMemory& memory,
                                DType dtype, bool exact_only,
                                absl::Duration timeout) {
  const int n = comm.size();
  const int me = comm.rank();
  Checker check(comm, absl::StrCat("exact reductions ", DTypeName(dtype)));
  // Rank r's element g is (r % 2 + 1) * k with k = 2^(g % 4): over the
  // group the sum is k * (n + n / 2), the max 2k (k alone on one rank) and
  // the min k. Every partial sum is k times an integer of at most 2n, exact
  // in every dtype for groups of up to 128 ranks, and power-of-two factors
  // only shift exponents, so only avg's division by n rounds, once, as the
  // closed form below does.
  const double total = n + n / 2;
  const double top = n >= 2 ? 2 : 1;
  const Reduction cases[] = {
      {ReduceOp::kSum, 1, 1}, {ReduceOp::kAvg, 1, 1}, {ReduceOp::kMax, 1, 1},
      {ReduceOp::kMin, 1, 1}, {ReduceOp::kSum, 2, 2}, {ReduceOp::kAvg, 2, 2},
      {ReduceOp::kSum, 1, 4}, {ReduceOp::kAvg, 4, 1},
  };
  const int64_t count = 11;
  auto value = [&](int rank, int64_t g) {
    return (rank % 2 + 1) * std::ldexp(1.0, static_cast<int>(g % 4));
  };
  for (const Reduction& c : cases) {
    // With a premultiplied average (NCCL's), x * (1 / n) rounds for each
    // input unless n is a power of two.
    if (exact_only && c.op == ReduceOp::kAvg && (n & (n - 1)) != 0) continue;
    ReduceOptions options;
    options.op = c.op;
    options.pre_divide_factor = c.pre;
    options.post_divide_factor = c.post;
    options = Timed(options, timeout);
    const std::string name =
        absl::StrFormat("%s pre %g post %g", ReduceOpName(c.op), c.pre, c.post);
    // The expected value, rounded into the dtype.
    auto expected = [&](int64_t g) {
      const double k = std::ldexp(1.0, static_cast<int>(g % 4));
      double v = 0;
      switch (c.op) {
        case ReduceOp::kSum:
          v = k * total / c.pre / c.post;
          break;
        case ReduceOp::kAvg:
          v = k * total / c.pre / n / c.post;
          break;
        case ReduceOp::kMax:
          v = k * top;
          break;
        case ReduceOp::kMin:
          v = k;
          break;
      }
      HostBuffer one(dtype, 1);
      StoreFromDouble(one.data(), dtype, 0, v);
      return LoadAsDouble(one.data(), dtype, 0);
    };
    // all_reduce of `count` elements, then reduce_scatter of n * count.
    for (bool scatter : {false, true}) {
      const int64_t in_count = scatter ? n * count : count;
      HostBuffer host(dtype, in_count);
      for (int64_t g = 0; g < in_count; ++g) {
        StoreFromDouble(host.data(), dtype, g, value(me, g));
      }
      absl::StatusOr<DeviceBuffer> in =
          DeviceBuffer::Allocate(memory, dtype, in_count);
      absl::StatusOr<DeviceBuffer> out =
          DeviceBuffer::Allocate(memory, dtype, count);
      if (!check.Ok(in.status(), "allocating") ||
          !check.Ok(out.status(), "allocating") ||
          !check.Ok(in->Upload(host), "uploading")) {
        return check.result();
      }
      const absl::Status status =
          scatter ? comm.ReduceScatter(in->ref(), out->ref(), options)->Wait()
                  : comm.AllReduce(in->ref(), out->ref(), options)->Wait();
      const char* op = scatter ? "reduce_scatter" : "all_reduce";
      if (!check.Ok(status, absl::StrCat(op, " ", name))) {
        return check.result();
      }
      std::vector<char> storage;
      absl::StatusOr<const void*> got = ReadBack(memory, out->ref(), storage);
      if (!check.Ok(got.status(), "reading back")) return check.result();
      for (int64_t i = 0; i < count && !check.failed(); ++i) {
        const int64_t g = scatter ? me * count + i : i;
        const double v = LoadAsDouble(*got, dtype, i);
        check.Expect(v == expected(g),
                     absl::StrFormat("%s %s: element %d is %.17g, expected "
                                     "%.17g",
                                     op, name, i, v, expected(g)));
      }
    }
  }
  return check.result();
}

CaseResult CheckAllGatherBytes(Communicator& comm, absl::Duration timeout) {
  const int n = comm.size();
  const int me = comm.rank();
  Checker check(comm, "all_gather_bytes");
  // Rank 0's string is empty; the others differ in length and hold NULs.
  auto make = [](int r) {
    std::string s;
    if (r == 0) return s;
    for (int j = 0; j < 3 + 37 * r; ++j) {
      s.push_back(j % 11 == 1 ? '\0' : static_cast<char>('a' + (r + j) % 26));
    }
    return s;
  };
  std::vector<std::string> want;
  for (int r = 0; r < n; ++r) want.push_back(make(r));
  absl::StatusOr<std::vector<std::string>> got =
      comm.AllGatherBytes(make(me), Timed(timeout));
  if (check.Ok(got.status(), "strings of different lengths")) {
    check.Expect(*got == want, "strings of different lengths differ");
  }
  got = comm.AllGatherBytes("", Timed(timeout));
  if (check.Ok(got.status(), "empty strings")) {
    check.Expect(*got == std::vector<std::string>(n), "empty strings differ");
  }
  const std::string big(1 << 20, 'z');
  std::vector<std::string> want_big(n);
  want_big[n - 1] = big;
  got = comm.AllGatherBytes(me == n - 1 ? big : "", Timed(timeout));
  if (check.Ok(got.status(), "1 MiB from the last rank")) {
    check.Expect(*got == want_big, "1 MiB from the last rank differs");
  }
  return check.result();
}

CaseResult CheckBarrier(Communicator& comm, absl::Duration timeout) {
  Checker check(comm, "barrier");
  for (int i = 0; i < 3; ++i) {
    check.Ok(comm.Barrier(Timed(timeout)), absl::StrCat("barrier ", i));
  }
  return check.result();
}

CaseResult CheckSplit(Communicator& comm, DeviceMemory& memory,
                      absl::Duration timeout) {
  const int n = comm.size();
  const int me = comm.rank();
  Checker check(comm, "split");
  {
    // By parity; key -rank orders each group by descending old rank.
    absl::StatusOr<std::unique_ptr<Communicator>> sub =
        comm.Split(me % 2, -me, Timed(timeout));
    if (!check.Ok(sub.status(), "split by parity")) return check.result();
    if (*sub == nullptr) {
      check.Expect(false, "split by parity returned no communicator");
      return check.result();
    }
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r) {
      if (r % 2 == me % 2) members.push_back(r);
    }
    const int want_rank =
        std::find(members.begin(), members.end(), me) - members.begin();
    check.Expect((*sub)->size() == static_cast<int>(members.size()),
                 absl::StrFormat("parity group has %d ranks, expected %d",
                                 (*sub)->size(), members.size()));
    check.Expect((*sub)->rank() == want_rank,
                 absl::StrFormat("rank in the parity group is %d, expected %d",
                                 (*sub)->rank(), want_rank));
    check.Expect((*sub)->backend() == comm.backend(),
                 "the parity group has another backend");
    check.Expect(GatherRanks(check, **sub, me, timeout) == ToStrings(members),
                 "the parity group's members or their order differ");
    ExpectGroupSum(check, **sub, memory, me, members, timeout);
  }
  {
    // Rank 0 joins no group.
    absl::StatusOr<std::unique_ptr<Communicator>> sub =
        comm.Split(me == 0 ? -1 : 7, me, Timed(timeout));
    if (!check.Ok(sub.status(), "split without rank 0")) return check.result();
    if (me == 0) {
      check.Expect(*sub == nullptr, "a negative color returned a communicator");
    } else if (*sub == nullptr) {
      check.Expect(false, "split without rank 0 returned no communicator");
    } else {
      check.Expect(
          (*sub)->size() == n - 1 && (*sub)->rank() == me - 1,
          absl::StrFormat("rank %d of %d in the group without rank "
                          "0, expected %d of %d",
                          (*sub)->rank(), (*sub)->size(), me - 1, n - 1));
      std::vector<int> members;
      for (int r = 1; r < n; ++r) members.push_back(r);
      check.Expect(GatherRanks(check, **sub, me, timeout) == ToStrings(members),
                   "the members of the group without rank 0 differ");
    }
  }
  // The parent still works.
  check.Ok(comm.Barrier(Timed(timeout)), "barrier after the splits");
  return check.result();
}

CaseResult CheckHybridGroups(Communicator& world, DeviceMemory& memory,
                             int shard_group_size, absl::Duration timeout) {
  const int n = world.size();
  const int me = world.rank();
  const int s = shard_group_size;
  Checker check(world, absl::StrCat("hybrid groups of ", s));
  absl::StatusOr<HybridGroups> groups =
      MakeHybridGroups(world, s, Timed(timeout));
  if (!check.Ok(groups.status(), "MakeHybridGroups")) return check.result();
  if (groups->shard == nullptr || groups->replicate == nullptr) {
    check.Expect(false, "MakeHybridGroups returned no communicator");
    return check.result();
  }
  const int node = me / s;
  const int local = me % s;
  std::vector<int> shard;
  for (int j = 0; j < s; ++j) shard.push_back(node * s + j);
  std::vector<int> replicate;
  for (int j = 0; j < n / s; ++j) replicate.push_back(j * s + local);
  check.Expect(
      groups->shard->size() == s && groups->shard->rank() == local,
      absl::StrFormat("rank %d of %d in the shard group, expected "
                      "%d of %d",
                      groups->shard->rank(), groups->shard->size(), local, s));
  check.Expect(
      groups->replicate->size() == n / s && groups->replicate->rank() == node,
      absl::StrFormat("rank %d of %d in the replicate group, "
                      "expected %d of %d",
                      groups->replicate->rank(), groups->replicate->size(),
                      node, n / s));
  check.Expect(
      GatherRanks(check, *groups->shard, me, timeout) == ToStrings(shard),
      "the shard group's members differ");
  check.Expect(GatherRanks(check, *groups->replicate, me, timeout) ==
                   ToStrings(replicate),
               "the replicate group's members differ");
  ExpectGroupSum(check, *groups->shard, memory, me, shard, timeout);
  ExpectGroupSum(check, *groups->replicate, memory, me, replicate, timeout);
  return check.result();
}

CaseResult CheckArgumentErrors(Communicator& comm, absl::Duration timeout) {
  const int n = comm.size();
  const int me = comm.rank();
  Checker check(comm, "argument errors");
  const std::string rank = absl::StrFormat("rank %d: ", me);
  const ReduceOptions reduce = Timed(ReduceOptions(), timeout);
  std::vector<float> in(3, 1.0f);
  std::vector<float> out(3 * n + 1, 0.0f);
  const ConstBufferRef input{in.data(), 3, DType::kFloat32};
  const BufferRef too_long{out.data(), 3 * n + 1, DType::kFloat32};

  // Mismatched sizes name the rank, the op, its sequence number and sizes,
  // and every call gets the next sequence number.
  int64_t seqs[2] = {-1, -1};
  for (int64_t& seq : seqs) {
    const absl::Status status =
        comm.AllGather(input, too_long, Timed(timeout))->Wait();
    check.ExpectError(status, absl::StatusCode::kInvalidArgument,
                      {rank, "all_gather #", absl::StrCat(3 * n + 1)},
                      "all_gather into a buffer too long");
    seq = SequenceNumber(status.message(), "all_gather #");
  }
  check.Expect(seqs[0] >= 0 && seqs[1] == seqs[0] + 1,
               absl::StrFormat("sequence numbers %d then %d, expected "
                               "consecutive ones",
                               seqs[0], seqs[1]));

  std::vector<int32_t> ints(3 * n);
  check.ExpectError(comm.AllReduce({ints.data(), 3, DType::kInt32},
                                   {ints.data(), 3, DType::kInt32}, reduce)
                        ->Wait(),
                    absl::StatusCode::kUnimplemented, {rank, "int32"},
                    "all_reduce of int32");

  std::vector<double> doubles(1);
  check.ExpectError(
      comm.ReduceScatter({out.data(), n, DType::kFloat32},
                         {doubles.data(), 1, DType::kFloat64}, reduce)
          ->Wait(),
      absl::StatusCode::kInvalidArgument, {rank, "reduce_scatter #"},
      "reduce_scatter from float32 into float64");

  check.ExpectError(comm.AllReduce({in.data(), -1, DType::kFloat32},
                                   {out.data(), -1, DType::kFloat32}, reduce)
                        ->Wait(),
                    absl::StatusCode::kInvalidArgument, {rank, "-1"},
                    "all_reduce of -1 elements");
  check.ExpectError(comm.AllReduce({nullptr, 3, DType::kFloat32},
                                   {out.data(), 3, DType::kFloat32}, reduce)
                        ->Wait(),
                    absl::StatusCode::kInvalidArgument, {rank, "null"},
                    "all_reduce from a null pointer");

  ReduceOptions max_divided = reduce;
  max_divided.op = ReduceOp::kMax;
  max_divided.pre_divide_factor = 2;
  check.ExpectError(
      comm.AllReduce(input, {out.data(), 3, DType::kFloat32}, max_divided)
          ->Wait(),
      absl::StatusCode::kInvalidArgument, {"max"}, "max with a divide factor");
  ReduceOptions negative = reduce;
  negative.post_divide_factor = -1;
  check.ExpectError(
      comm.AllReduce(input, {out.data(), 3, DType::kFloat32}, negative)->Wait(),
      absl::StatusCode::kInvalidArgument, {}, "a negative divide factor");

  BroadcastOptions bad_root;
  bad_root.timeout = timeout;
  bad_root.root = n;
  check.ExpectError(
      comm.Broadcast({out.data(), 3, DType::kFloat32}, bad_root)->Wait(),
      absl::StatusCode::kInvalidArgument, {rank, "root"},
      "a broadcast root outside the group");

  check.ExpectError(MakeHybridGroups(comm, n + 1, Timed(timeout)).status(),
                    absl::StatusCode::kInvalidArgument, {},
                    "shard groups that do not divide the world");

  // Waiting twice gives the same status; and the group still works.
  std::unique_ptr<Work> bad = comm.AllGather(input, too_long, Timed(timeout));
  const absl::Status first = bad->Wait();
  check.Expect(bad->Wait() == first, "a second Wait() returned another status");
  float one = 1.0f;
  float sum = 0.0f;
  std::unique_ptr<Work> good = comm.AllReduce(
      {&one, 1, DType::kFloat32}, {&sum, 1, DType::kFloat32}, reduce);
  if (check.Ok(good->Wait(), "all_reduce after the errors")) {
    check.Ok(good->Wait(), "a second Wait() of the all_reduce");
    check.Expect(sum == static_cast<float>(n),
                 absl::StrFormat("all_reduce after the errors gave %g, "
                                 "expected %d",
                                 sum, n));
  }
  return check.result();
}

// The digest of `bytes` bytes at `data`.
uint64_t Digest(const void* data, size_t bytes) {
  return XXH3_64bits(data, bytes);
}

}  // namespace

std::vector<DType> CollectiveDTypes() {
  return {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};
}

std::vector<int64_t> InterestingCounts() {
  return {0, 1, 2, 3, 7, 13, 61, 1031};
}

std::vector<CollectiveCase> CollectiveCases(int n,
                                            const SuiteOptions& options) {
  std::vector<CollectiveCase> cases;
  auto add = [&](const CollectiveCase& c) {
    if (!options.exact_only || IsOrderIndependent(c, n)) cases.push_back(c);
  };
  for (DType dtype : options.dtypes) {
    for (int64_t count : options.counts) {
      CollectiveCase c;
      c.dtype = dtype;
      c.count = count;
      c.kind = CollectiveKind::kAllGather;
      for (bool in_place : {false, true}) {
        c.in_place = in_place;
        add(c);
      }
      for (CollectiveKind kind :
           {CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce}) {
        c.kind = kind;
        for (Values values : {Values::kInexact, Values::kExact}) {
          c.values = values;
          for (const Reduction& r : kReductions) {
            c.op = r.op;
            c.pre_divide_factor = r.pre;
            c.post_divide_factor = r.post;
            for (bool in_place : {false, true}) {
              c.in_place = in_place;
              add(c);
            }
          }
        }
      }
      CollectiveCase b;
      b.kind = CollectiveKind::kBroadcast;
      b.dtype = dtype;
      b.count = count;
      for (int root : {0, n - 1}) {
        if (root == n - 1 && n == 1) break;
        b.root = root;
        add(b);
      }
    }
    if (options.large_elements > 0) {
      const int64_t large = options.large_elements;
      CollectiveCase c;
      c.dtype = dtype;
      c.values = Values::kExact;
      c.kind = CollectiveKind::kAllGather;
      c.count = std::max<int64_t>(1, large / n);
      add(c);
      c.kind = CollectiveKind::kReduceScatter;
      c.in_place = true;
      add(c);
      c.kind = CollectiveKind::kAllReduce;
      c.count = large;
      c.in_place = false;
      c.pre_divide_factor = 2;
      c.post_divide_factor = 4;
      add(c);
      CollectiveCase b;
      b.kind = CollectiveKind::kBroadcast;
      b.dtype = dtype;
      b.values = Values::kExact;
      b.count = large;
      b.root = n - 1;
      add(b);
    }
  }
  return cases;
}

CaseResult RunCase(Communicator& comm, DeviceMemory& memory,
                   const CollectiveCase& c, absl::Duration timeout) {
  const int n = comm.size();
  const int me = comm.rank();
  const std::string prefix = Prefix(comm, c.Name());
  CaseResult result;
  auto fail = [&](const absl::Status& status, absl::string_view what) {
    result.status = absl::Status(
        status.code(), absl::StrCat(prefix, ": ", what, status.message()));
    return result;
  };
  absl::StatusOr<Prepared> prepared = Prepare(c, n, me, memory);
  if (!prepared.ok()) return fail(prepared.status(), "setting up: ");
  const Prepared& p = *prepared;
  const absl::Status status = Issue(comm, c, p, timeout);
  if (!status.ok()) {
    result.collective_error = true;
    return fail(status, "");
  }

  const HostBuffer want = ExpectedOutput(c, n, me);
  std::vector<char> storage;
  absl::StatusOr<const void*> got = ReadBack(memory, p.output_ref, storage);
  if (!got.ok()) return fail(got.status(), "reading the output back: ");
  int64_t first = -1;
  result.wrong =
      CountMismatches(*got, want.data(), want.count(), c.dtype, &first);
  if (result.wrong > 0) {
    result.status = absl::InternalError(
        absl::StrFormat("%s: output %s; %d of %d elements differ", prefix,
                        DescribeMismatch(*got, want.data(), c.dtype, first),
                        result.wrong, want.count()));
    return result;
  }
  if (p.input.count() > 0 && c.kind != CollectiveKind::kBroadcast) {
    HostBuffer input(c.dtype, p.input.count());
    FillInput(c, me, 0, input.ref());
    got = ReadBack(memory, p.input.ref(), storage);
    if (!got.ok()) return fail(got.status(), "reading the input back: ");
    const int64_t changed =
        CountMismatches(*got, input.data(), input.count(), c.dtype, &first);
    if (changed > 0) {
      result.status = absl::InternalError(absl::StrFormat(
          "%s: the collective changed its input: %s; %d of %d elements "
          "differ",
          prefix, DescribeMismatch(*got, input.data(), c.dtype, first), changed,
          input.count()));
    }
  }
  return result;
}

std::vector<GroupCheck> GroupChecks(int n, Device device,
                                    const SuiteOptions& options) {
  const absl::Duration timeout = options.timeout;
  std::vector<GroupCheck> checks;
  for (DType dtype : options.dtypes) {
    const bool exact_only = options.exact_only;
    checks.push_back({absl::StrCat("exact reductions ", DTypeName(dtype)),
                      [dtype, exact_only, timeout](Communicator& comm,
                                                   DeviceMemory& memory) {
                        return CheckExactReductions(comm, memory, dtype,
                                                    exact_only, timeout);
                      }});
  }
  checks.push_back(
      {"all_gather_bytes", [timeout](Communicator& comm, DeviceMemory&) {
         return CheckAllGatherBytes(comm, timeout);
       }});
  checks.push_back({"barrier", [timeout](Communicator& comm, DeviceMemory&) {
                      return CheckBarrier(comm, timeout);
                    }});
  checks.push_back(
      {"split", [timeout](Communicator& comm, DeviceMemory& memory) {
         return CheckSplit(comm, memory, timeout);
       }});
  for (int s = 1; s <= n; ++s) {
    if (n % s != 0) continue;
    checks.push_back({absl::StrCat("hybrid groups of ", s),
                      [s, timeout](Communicator& comm, DeviceMemory& memory) {
                        return CheckHybridGroups(comm, memory, s, timeout);
                      }});
  }
  if (device.type == DeviceType::kHost) {
    checks.push_back(
        {"argument errors", [timeout](Communicator& comm, DeviceMemory&) {
           return CheckArgumentErrors(comm, timeout);
         }});
  }
  return checks;
}

absl::Status SuiteReport::ToStatus() const {
  if (!stopped.ok()) {
    return absl::Status(
        stopped.code(),
        absl::StrFormat("%s (the suite stopped there, after %d cases, %d of "
                        "them failed)",
                        stopped.message(), cases, failed));
  }
  if (failed == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat(
      "%d of %d conformance cases failed:\n  %s%s", failed, cases,
      absl::StrJoin(failures, "\n  "),
      failed > static_cast<int64_t>(failures.size()) ? "\n  ..." : ""));
}

void SuiteReport::Add(const CaseResult& result, int max_reported_failures) {
  ++cases;
  if (result.status.ok()) return;
  ++failed;
  if (result.collective_error && stopped.ok()) {
    stopped = result.status;
  } else if (static_cast<int>(failures.size()) < max_reported_failures) {
    failures.emplace_back(result.status.message());
  }
}

SuiteReport RunSuite(Communicator& comm, DeviceMemory& memory,
                     const SuiteOptions& options) {
  SuiteReport report;
  const int n = comm.size();
  for (const CollectiveCase& c : CollectiveCases(n, options)) {
    report.Add(RunCase(comm, memory, c, options.timeout),
               options.max_reported_failures);
    if (!report.stopped.ok()) return report;
  }
  if (!options.group_checks) return report;
  for (const GroupCheck& check : GroupChecks(n, memory.device(), options)) {
    report.Add(check.run(comm, memory), options.max_reported_failures);
    if (!report.stopped.ok()) return report;
  }
  return report;
}

// ---------------------------------------------------------------------------
// Digests.

std::vector<CollectiveCase> DigestCases(int n) {
  std::vector<CollectiveCase> cases;
  for (DType dtype : CollectiveDTypes()) {
    CollectiveCase c;
    c.dtype = dtype;
    c.kind = CollectiveKind::kAllGather;
    c.count = 13;
    cases.push_back(c);
    for (CollectiveKind kind :
         {CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce}) {
      c.kind = kind;
      c.count = kind == CollectiveKind::kReduceScatter ? 7 : 1031;
      for (Values values : {Values::kInexact, Values::kExact}) {
        c.values = values;
        for (const Reduction& r : kReductions) {
          c.op = r.op;
          c.pre_divide_factor = r.pre;
          c.post_divide_factor = r.post;
          cases.push_back(c);
        }
      }
    }
    CollectiveCase b;
    b.kind = CollectiveKind::kBroadcast;
    b.dtype = dtype;
    b.count = 61;
    b.root = n - 1;
    cases.push_back(b);
  }
  return cases;
}

absl::StatusOr<DigestTable> ComputeDigests(Communicator& comm,
                                           DeviceMemory& memory,
                                           absl::Duration timeout) {
  const int n = comm.size();
  const int me = comm.rank();
  const std::vector<CollectiveCase> cases = DigestCases(n);
  std::string mine;
  for (const CollectiveCase& c : cases) {
    const std::string prefix = Prefix(comm, c.Name());
    absl::StatusOr<Prepared> p = Prepare(c, n, me, memory);
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat(prefix, ": ", p.status().message()));
    }
    const absl::Status status = Issue(comm, c, *p, timeout);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat(prefix, ": ", status.message()));
    }
    std::vector<char> storage;
    absl::StatusOr<const void*> got = ReadBack(memory, p->output_ref, storage);
    if (!got.ok()) return got.status();
    const uint64_t digest =
        Digest(*got, static_cast<size_t>(p->output_ref.bytes()));
    mine.append(reinterpret_cast<const char*>(&digest), sizeof(digest));
  }
  absl::StatusOr<std::vector<std::string>> all =
      comm.AllGatherBytes(mine, Timed(timeout));
  if (!all.ok()) {
    return absl::Status(all.status().code(),
                        absl::StrCat(Prefix(comm, "gathering digests"), ": ",
                                     all.status().message()));
  }
  DigestTable table(cases.size(), std::vector<uint64_t>(n));
  for (int r = 0; r < n; ++r) {
    if ((*all)[r].size() != cases.size() * sizeof(uint64_t)) {
      return absl::InternalError(
          absl::StrFormat("%s: rank %d sent %d bytes of digests, expected %d",
                          Prefix(comm, "gathering digests"), r,
                          (*all)[r].size(), cases.size() * sizeof(uint64_t)));
    }
    for (size_t i = 0; i < cases.size(); ++i) {
      std::memcpy(&table[i][r], (*all)[r].data() + i * sizeof(uint64_t),
                  sizeof(uint64_t));
    }
  }
  return table;
}

DigestTable ReferenceDigests(int n) {
  const std::vector<CollectiveCase> cases = DigestCases(n);
  DigestTable table(cases.size(), std::vector<uint64_t>(n));
  for (size_t i = 0; i < cases.size(); ++i) {
    for (int r = 0; r < n; ++r) {
      const HostBuffer want = ExpectedOutput(cases[i], n, r);
      table[i][r] = Digest(want.data(), static_cast<size_t>(want.bytes()));
    }
  }
  return table;
}

absl::Status CompareDigests(const DigestTable& got, const DigestTable& want,
                            int n) {
  const std::vector<CollectiveCase> cases = DigestCases(n);
  if (got.size() != want.size()) {
    return absl::InternalError(absl::StrFormat("%d digest rows, expected %d",
                                               got.size(), want.size()));
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].size() != want[i].size()) {
      return absl::InternalError(absl::StrFormat(
          "%d digests for %s, expected %d", got[i].size(),
          i < cases.size() ? cases[i].Name() : "?", want[i].size()));
    }
    for (size_t r = 0; r < got[i].size(); ++r) {
      if (got[i][r] != want[i][r]) {
        return absl::InternalError(absl::StrFormat(
            "the output of %s on rank %d of %d has digest %016x, the "
            "reference %016x",
            i < cases.size() ? cases[i].Name() : "?", r, n, got[i][r],
            want[i][r]));
      }
    }
  }
  return absl::OkStatus();
}

uint64_t CombineDigests(const DigestTable& table) {
  std::vector<uint64_t> all;
  for (const std::vector<uint64_t>& row : table) {
    all.insert(all.end(), row.begin(), row.end());
  }
  return Digest(all.data(), all.size() * sizeof(uint64_t));
}

}  // namespace conformance
}  // namespace flatparam
