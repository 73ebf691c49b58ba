#include "comm/mpi/collective_cases.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/host_reduce.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace conformance {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

CollectiveOptions Timed() {
  CollectiveOptions options;
  options.timeout = kCaseTimeout;
  return options;
}

ReduceOptions Timed(ReduceOptions options) {
  options.timeout = kCaseTimeout;
  return options;
}

std::string Describe(const ReduceOptions& options) {
  return absl::StrFormat("%s pre %g post %g", ReduceOpName(options.op),
                         options.pre_divide_factor, options.post_divide_factor);
}

// Garbage that is not zero, so a missing write shows.
void Scribble(BufferRef buffer) {
  if (buffer.count > 0) std::memset(buffer.data, 0x5A, buffer.bytes());
}

// Compares element bit patterns; reports the first few differences.
void ExpectSameElements(const void* got, const void* want, int64_t count,
                        DType dtype, absl::string_view what) {
  const size_t size = DTypeSize(dtype);
  int reported = 0;
  int64_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i) {
    const char* g = static_cast<const char*>(got) + i * size;
    const char* w = static_cast<const char*>(want) + i * size;
    if (std::memcmp(g, w, size) == 0) continue;
    ++mismatches;
    if (reported++ < 3) {
      ADD_FAILURE() << what << ": element " << i << " is "
                    << LoadAsDouble(got, dtype, i) << ", expected "
                    << LoadAsDouble(want, dtype, i);
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": " << mismatches << " of " << count
                           << " elements differ";
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

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// The members of a group as world ranks, gathered through the group itself.
std::vector<std::string> GatherRanks(Communicator& group, int world_rank) {
  absl::StatusOr<std::vector<std::string>> ranks =
      group.AllGatherBytes(absl::StrCat(world_rank), Timed());
  EXPECT_THAT(ranks, IsOk());
  return ranks.ok() ? *ranks : std::vector<std::string>();
}

std::vector<std::string> ToStrings(const std::vector<int>& ranks) {
  std::vector<std::string> out;
  for (int r : ranks) out.push_back(absl::StrCat(r));
  return out;
}

// Sums (world rank + 1) over `group` and checks it against `members`.
void ExpectGroupSum(Communicator& group, int world_rank,
                    const std::vector<int>& members) {
  float value = static_cast<float>(world_rank + 1);
  float sum = 0;
  ReduceOptions options = Timed(ReduceOptions());
  EXPECT_THAT(group
                  .AllReduce({&value, 1, DType::kFloat32},
                             {&sum, 1, DType::kFloat32}, options)
                  ->Wait(),
              IsOk());
  float want = 0;
  for (int m : members) want += static_cast<float>(m + 1);
  EXPECT_EQ(sum, want);
}

}  // namespace

std::vector<DType> CollectiveDTypes() {
  return {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};
}

std::vector<int64_t> InterestingCounts() { return {0, 1, 2, 7, 13, 1031}; }

HostBuffer::HostBuffer(DType dtype, int64_t count)
    : dtype_(dtype), count_(count), bytes_(count * DTypeSize(dtype)) {}

BufferRef HostBuffer::ref() {
  return {bytes_.data(), count_, dtype_, Device::Host()};
}

ConstBufferRef HostBuffer::cref() const {
  return {bytes_.data(), count_, dtype_, Device::Host()};
}

void FillInput(BufferRef buffer, int rank, int salt) {
  for (int64_t i = 0; i < buffer.count; ++i) {
    const double v = std::sin(0.731 * static_cast<double>(i + 1) + 1.37 * rank +
                              0.113 * salt) *
                     (1.0 + static_cast<double>(i % 17));
    StoreFromDouble(buffer.data, buffer.dtype, i, v);
  }
}

void CheckAllGather(Communicator& comm, DType dtype, int64_t count,
                    bool in_place) {
  const int n = comm.size();
  const int me = comm.rank();
  SCOPED_TRACE(absl::StrFormat("all_gather %s count %d%s, rank %d of %d",
                               DTypeName(dtype), count,
                               in_place ? " in place" : "", me, n));
  HostBuffer output(dtype, n * count);
  Scribble(output.ref());
  HostBuffer own(dtype, count);
  FillInput(own.ref(), me, 1);
  ConstBufferRef input = own.cref();
  if (in_place) {
    BufferRef slot = output.ref().Slice(me * count, count);
    if (count > 0)
      std::memcpy(slot.data, own.bytes().data(), own.ref().bytes());
    input = slot;
  }
  EXPECT_THAT(comm.AllGather(input, output.ref(), Timed())->Wait(), IsOk());

  HostBuffer want(dtype, n * count);
  for (int r = 0; r < n; ++r) {
    FillInput(want.ref().Slice(r * count, count), r, 1);
  }
  ExpectSameElements(output.bytes().data(), want.bytes().data(), n * count,
                     dtype, "output");
  HostBuffer own_again(dtype, count);
  FillInput(own_again.ref(), me, 1);
  ExpectSameElements(own.bytes().data(), own_again.bytes().data(), count, dtype,
                     "input after the collective");
}

void CheckReduceScatter(Communicator& comm, DType dtype, int64_t count,
                        const ReduceOptions& options, bool in_place) {
  const int n = comm.size();
  const int me = comm.rank();
  SCOPED_TRACE(absl::StrFormat("reduce_scatter %s count %d %s%s, rank %d of %d",
                               DTypeName(dtype), count, Describe(options),
                               in_place ? " in place" : "", me, n));
  HostBuffer input(dtype, n * count);
  FillInput(input.ref(), me, 2);
  HostBuffer separate_output(dtype, count);
  Scribble(separate_output.ref());
  BufferRef output =
      in_place ? input.ref().Slice(me * count, count) : separate_output.ref();
  EXPECT_THAT(comm.ReduceScatter(input.cref(), output, Timed(options))->Wait(),
              IsOk());

  std::vector<HostBuffer> all;
  std::vector<const void*> slices;
  for (int r = 0; r < n; ++r) {
    all.emplace_back(dtype, n * count);
  }
  for (int r = 0; r < n; ++r) {
    FillInput(all[r].ref(), r, 2);
    slices.push_back(all[r].ref().Slice(me * count, count).data);
  }
  HostBuffer want(dtype, count);
  HostReduce(slices, want.ref().data, count, dtype, options, n);
  ExpectSameElements(output.data, want.bytes().data(), count, dtype, "output");
  if (!in_place) {
    ExpectSameElements(input.bytes().data(), all[me].bytes().data(), n * count,
                       dtype, "input after the collective");
  }
}

void CheckAllReduce(Communicator& comm, DType dtype, int64_t count,
                    const ReduceOptions& options, bool in_place) {
  const int n = comm.size();
  const int me = comm.rank();
  SCOPED_TRACE(absl::StrFormat("all_reduce %s count %d %s%s, rank %d of %d",
                               DTypeName(dtype), count, Describe(options),
                               in_place ? " in place" : "", me, n));
  HostBuffer input(dtype, count);
  FillInput(input.ref(), me, 3);
  HostBuffer separate_output(dtype, count);
  Scribble(separate_output.ref());
  BufferRef output = in_place ? input.ref() : separate_output.ref();
  EXPECT_THAT(comm.AllReduce(input.cref(), output, Timed(options))->Wait(),
              IsOk());

  std::vector<HostBuffer> all;
  std::vector<const void*> inputs;
  for (int r = 0; r < n; ++r) all.emplace_back(dtype, count);
  for (int r = 0; r < n; ++r) {
    FillInput(all[r].ref(), r, 3);
    inputs.push_back(all[r].ref().data);
  }
  HostBuffer want(dtype, count);
  HostReduce(inputs, want.ref().data, count, dtype, options, n);
  ExpectSameElements(output.data, want.bytes().data(), count, dtype, "output");
  if (!in_place) {
    ExpectSameElements(input.bytes().data(), all[me].bytes().data(), count,
                       dtype, "input after the collective");
  }
}

void CheckBroadcast(Communicator& comm, DType dtype, int64_t count, int root) {
  const int me = comm.rank();
  SCOPED_TRACE(absl::StrFormat("broadcast %s count %d root %d, rank %d of %d",
                               DTypeName(dtype), count, root, me, comm.size()));
  HostBuffer buffer(dtype, count);
  if (me == root) {
    FillInput(buffer.ref(), root, 4);
  } else {
    Scribble(buffer.ref());
  }
  BroadcastOptions options;
  options.timeout = kCaseTimeout;
  options.root = root;
  EXPECT_THAT(comm.Broadcast(buffer.ref(), options)->Wait(), IsOk());
  HostBuffer want(dtype, count);
  FillInput(want.ref(), root, 4);
  ExpectSameElements(buffer.bytes().data(), want.bytes().data(), count, dtype,
                     "buffer");
}

void CheckExactReductions(Communicator& comm, DType dtype) {
  const int n = comm.size();
  const int me = comm.rank();
  // Rank r's element g is (r + 1) * k with k = g % 5 + 1: over the group
  // the sum is k * n(n+1)/2, the max k * n and the min k. Every value and
  // partial sum here is exact in every dtype for small groups.
  const double triangle = n * (n + 1) / 2.0;
  struct Case {
    ReduceOp op;
    double pre;
    double post;
  };
  const Case cases[] = {
      {ReduceOp::kSum, 1, 1}, {ReduceOp::kAvg, 1, 1}, {ReduceOp::kMax, 1, 1},
      {ReduceOp::kMin, 1, 1}, {ReduceOp::kSum, 2, 2}, {ReduceOp::kAvg, 2, 2},
      {ReduceOp::kSum, 1, 4}, {ReduceOp::kAvg, 4, 1},
  };
  const int64_t count = 11;
  auto expected = [&](const Case& c, int64_t g) {
    const double k = static_cast<double>(g % 5 + 1);
    double v = 0;
    switch (c.op) {
      case ReduceOp::kSum:
        v = k * triangle / c.pre / c.post;
        break;
      case ReduceOp::kAvg:
        v = k * triangle / c.pre / n / c.post;
        break;
      case ReduceOp::kMax:
        v = k * n;
        break;
      case ReduceOp::kMin:
        v = k;
        break;
    }
    // The value as the dtype holds it.
    double rounded[1];
    StoreFromDouble(rounded, DType::kFloat64, 0, v);
    HostBuffer one(dtype, 1);
    StoreFromDouble(one.ref().data, dtype, 0, rounded[0]);
    return LoadAsDouble(one.ref().data, dtype, 0);
  };
  for (const Case& c : cases) {
    ReduceOptions options;
    options.op = c.op;
    options.pre_divide_factor = c.pre;
    options.post_divide_factor = c.post;
    SCOPED_TRACE(absl::StrFormat("exact %s %s, rank %d of %d", DTypeName(dtype),
                                 Describe(options), me, n));
    options = Timed(options);

    HostBuffer input(dtype, count);
    for (int64_t g = 0; g < count; ++g) {
      StoreFromDouble(input.ref().data, dtype, g, (me + 1) * (g % 5 + 1));
    }
    HostBuffer output(dtype, count);
    EXPECT_THAT(comm.AllReduce(input.cref(), output.ref(), options)->Wait(),
                IsOk());
    for (int64_t g = 0; g < count; ++g) {
      EXPECT_EQ(LoadAsDouble(output.ref().data, dtype, g), expected(c, g))
          << "all_reduce element " << g;
    }

    HostBuffer rs_input(dtype, n * count);
    for (int64_t g = 0; g < n * count; ++g) {
      StoreFromDouble(rs_input.ref().data, dtype, g, (me + 1) * (g % 5 + 1));
    }
    HostBuffer rs_output(dtype, count);
    EXPECT_THAT(
        comm.ReduceScatter(rs_input.cref(), rs_output.ref(), options)->Wait(),
        IsOk());
    for (int64_t i = 0; i < count; ++i) {
      EXPECT_EQ(LoadAsDouble(rs_output.ref().data, dtype, i),
                expected(c, me * count + i))
          << "reduce_scatter element " << i;
    }
  }
}

void CheckAllGatherBytes(Communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();
  SCOPED_TRACE(absl::StrFormat("all_gather_bytes, rank %d of %d", me, n));
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
      comm.AllGatherBytes(make(me), Timed());
  EXPECT_THAT(got, IsOk());
  if (got.ok()) {
    EXPECT_TRUE(*got == want);
  }
  // Nothing at all.
  got = comm.AllGatherBytes("", Timed());
  EXPECT_THAT(got, IsOk());
  if (got.ok()) {
    EXPECT_EQ(*got, std::vector<std::string>(n));
  }
  // One large string from the last rank.
  const std::string big(1 << 20, 'z');
  std::vector<std::string> want_big(n);
  want_big[n - 1] = big;
  got = comm.AllGatherBytes(me == n - 1 ? big : "", Timed());
  EXPECT_THAT(got, IsOk());
  if (got.ok()) {
    EXPECT_TRUE(*got == want_big);
  }
}

void CheckBarrier(Communicator& comm) {
  SCOPED_TRACE(absl::StrFormat("barrier, rank %d", comm.rank()));
  for (int i = 0; i < 3; ++i) EXPECT_THAT(comm.Barrier(Timed()), IsOk());
}

void CheckSplit(Communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();
  SCOPED_TRACE(absl::StrFormat("split, rank %d of %d", me, n));
  {
    // By parity; key -rank orders each group by descending old rank.
    absl::StatusOr<std::unique_ptr<Communicator>> sub =
        comm.Split(me % 2, -me, Timed());
    ASSERT_THAT(sub, IsOk());
    ASSERT_NE(*sub, nullptr);
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r) {
      if (r % 2 == me % 2) members.push_back(r);
    }
    EXPECT_EQ((*sub)->size(), static_cast<int>(members.size()));
    EXPECT_EQ((*sub)->rank(),
              std::find(members.begin(), members.end(), me) - members.begin());
    EXPECT_EQ((*sub)->backend(), comm.backend());
    EXPECT_EQ(GatherRanks(**sub, me), ToStrings(members));
    ExpectGroupSum(**sub, me, members);
  }
  {
    // Rank 0 joins no group.
    absl::StatusOr<std::unique_ptr<Communicator>> sub =
        comm.Split(me == 0 ? -1 : 7, me, Timed());
    ASSERT_THAT(sub, IsOk());
    if (me == 0) {
      EXPECT_EQ(*sub, nullptr);
    } else {
      ASSERT_NE(*sub, nullptr);
      EXPECT_EQ((*sub)->size(), n - 1);
      EXPECT_EQ((*sub)->rank(), me - 1);
      std::vector<int> members = Iota(n);
      members.erase(members.begin());
      EXPECT_EQ(GatherRanks(**sub, me), ToStrings(members));
    }
  }
  // The parent still works.
  EXPECT_THAT(comm.Barrier(Timed()), IsOk());
}

void CheckHybridGroups(Communicator& world, int shard_group_size) {
  const int n = world.size();
  const int me = world.rank();
  const int s = shard_group_size;
  SCOPED_TRACE(absl::StrFormat("hybrid groups of %d, rank %d of %d", s, me, n));
  absl::StatusOr<HybridGroups> groups = MakeHybridGroups(world, s, Timed());
  ASSERT_THAT(groups, IsOk());
  ASSERT_NE(groups->shard, nullptr);
  ASSERT_NE(groups->replicate, nullptr);
  const int node = me / s;
  const int local = me % s;
  std::vector<int> shard;
  for (int j = 0; j < s; ++j) shard.push_back(node * s + j);
  std::vector<int> replicate;
  for (int j = 0; j < n / s; ++j) replicate.push_back(j * s + local);
  EXPECT_EQ(groups->shard->size(), s);
  EXPECT_EQ(groups->shard->rank(), local);
  EXPECT_EQ(groups->replicate->size(), n / s);
  EXPECT_EQ(groups->replicate->rank(), node);
  EXPECT_EQ(GatherRanks(*groups->shard, me), ToStrings(shard));
  EXPECT_EQ(GatherRanks(*groups->replicate, me), ToStrings(replicate));
  ExpectGroupSum(*groups->shard, me, shard);
  ExpectGroupSum(*groups->replicate, me, replicate);
}

void CheckArgumentErrors(Communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();
  SCOPED_TRACE(absl::StrFormat("argument errors, rank %d of %d", me, n));
  const std::string rank = absl::StrFormat("rank %d: ", me);
  std::vector<float> in(3, 1.0f);
  std::vector<float> out(3 * n + 1, 0.0f);
  const ConstBufferRef input{in.data(), 3, DType::kFloat32};
  const BufferRef too_long{out.data(), 3 * n + 1, DType::kFloat32};

  // Mismatched sizes name the rank, the op, its sequence number and sizes,
  // and every call gets the next sequence number.
  int64_t seqs[2] = {-1, -1};
  for (int64_t& seq : seqs) {
    const absl::Status status =
        comm.AllGather(input, too_long, Timed())->Wait();
    EXPECT_THAT(status,
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(rank), HasSubstr("all_gather #"),
                               HasSubstr(absl::StrFormat("%d", 3 * n + 1)))));
    seq = SequenceNumber(status.message(), "all_gather #");
  }
  EXPECT_GE(seqs[0], 0);
  EXPECT_EQ(seqs[1], seqs[0] + 1);

  // An unsupported dtype.
  std::vector<int32_t> ints(3 * n);
  EXPECT_THAT(
      comm.AllReduce({ints.data(), 3, DType::kInt32},
                     {ints.data(), 3, DType::kInt32}, Timed(ReduceOptions()))
          ->Wait(),
      StatusIs(absl::StatusCode::kUnimplemented,
               AllOf(HasSubstr(rank), HasSubstr("int32"))));

  // Input and output dtypes differ.
  std::vector<double> doubles(1);
  EXPECT_THAT(comm.ReduceScatter({out.data(), n, DType::kFloat32},
                                 {doubles.data(), 1, DType::kFloat64},
                                 Timed(ReduceOptions()))
                  ->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(rank), HasSubstr("reduce_scatter #"))));

  // A negative count and a null pointer.
  EXPECT_THAT(
      comm.AllReduce({in.data(), -1, DType::kFloat32},
                     {out.data(), -1, DType::kFloat32}, Timed(ReduceOptions()))
          ->Wait(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr(rank), HasSubstr("-1"))));
  EXPECT_THAT(
      comm.AllReduce({nullptr, 3, DType::kFloat32},
                     {out.data(), 3, DType::kFloat32}, Timed(ReduceOptions()))
          ->Wait(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr(rank), HasSubstr("null"))));

  // Divide factors need sum or avg, and must be positive.
  ReduceOptions max_divided;
  max_divided.op = ReduceOp::kMax;
  max_divided.pre_divide_factor = 2;
  EXPECT_THAT(comm.AllReduce(input, {out.data(), 3, DType::kFloat32},
                             Timed(max_divided))
                  ->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max")));
  ReduceOptions negative;
  negative.post_divide_factor = -1;
  EXPECT_THAT(
      comm.AllReduce(input, {out.data(), 3, DType::kFloat32}, Timed(negative))
          ->Wait(),
      StatusIs(absl::StatusCode::kInvalidArgument));

  // A root outside the group.
  BroadcastOptions bad_root;
  bad_root.timeout = kCaseTimeout;
  bad_root.root = n;
  EXPECT_THAT(
      comm.Broadcast({out.data(), 3, DType::kFloat32}, bad_root)->Wait(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr(rank), HasSubstr("root"))));

  // Shard groups that do not divide the world.
  EXPECT_THAT(MakeHybridGroups(comm, n + 1, Timed()),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // Waiting twice gives the same status; and the group still works.
  std::unique_ptr<Work> bad = comm.AllGather(input, too_long, Timed());
  const absl::Status first = bad->Wait();
  EXPECT_EQ(bad->Wait(), first);
  float one = 1.0f;
  float sum = 0.0f;
  std::unique_ptr<Work> good =
      comm.AllReduce({&one, 1, DType::kFloat32}, {&sum, 1, DType::kFloat32},
                     Timed(ReduceOptions()));
  EXPECT_THAT(good->Wait(), IsOk());
  EXPECT_THAT(good->Wait(), IsOk());
  EXPECT_EQ(sum, static_cast<float>(n));
}

}  // namespace conformance
}  // namespace flatparam
