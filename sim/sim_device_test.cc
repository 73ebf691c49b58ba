#include "sim/sim_device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "sim/sim.h"

namespace flatparam {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

std::vector<float> Read(SimDeviceOps& ops, const DeviceBuffer& b) {
  EXPECT_THAT(ops.Synchronize(), IsOk());
  const float* p = static_cast<const float*>(b.data());
  return std::vector<float>(p, p + b.bytes() / 4);
}

// Stream 1 produces, the default stream consumes: with the event the
// result is right for every seed and nothing is reported; without it the
// detector reports the race whatever the seed, and some seeds compute the
// wrong value.
TEST(SimDeviceTest, AMissingWaitIsARaceForEverySeed) {
  int wrong = 0;
  for (uint64_t seed = 0; seed < 16; ++seed) {
    for (bool wait : {true, false}) {
      SimDeviceOps ops({seed});
      FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
      FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                     ops.Allocate(ops.device(), 4 * 4));
      FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer y,
                                     ops.Allocate(ops.device(), 4 * 4));
      BufferRef xs = x.As(DType::kFloat32), ys = y.As(DType::kFloat32);
      ASSERT_THAT(ops.Fill(ys, 0), IsOk());
      ASSERT_THAT(ops.SetStream(side), IsOk());
      ASSERT_THAT(ops.Fill(xs, 1), IsOk());
      ASSERT_THAT(ops.Scale(xs, ScaleOp::kMultiply, 3), IsOk());
      FLATPARAM_ASSERT_OK_AND_ASSIGN(Event produced, ops.RecordEvent(side));
      ASSERT_THAT(ops.SetStream(Stream{0}), IsOk());
      if (wait) {
        ASSERT_THAT(ops.WaitEvent(Stream{0}, produced), IsOk());
      }
      ASSERT_THAT(ops.Add(ys, xs), IsOk());
      const std::vector<float> got = Read(ops, y);
      if (wait) {
        EXPECT_THAT(got, ElementsAre(3, 3, 3, 3)) << seed;
        EXPECT_THAT(ops.reports(), IsEmpty()) << seed;
      } else {
        wrong += got[0] != 3;
        ASSERT_EQ(ops.reports().size(), 1u) << seed;
        EXPECT_THAT(ops.reports()[0],
                    HasSubstr("race: add (stream 0, reads 4 x float32"));
        EXPECT_THAT(ops.reports()[0],
                    HasSubstr("is not ordered after scale (multiply) (stream "
                              "1, writes"));
        EXPECT_THAT(ops.CheckNoRaces(),
                    StatusIs(absl::StatusCode::kInternal,
                             HasSubstr("1 stream ordering problem")));
      }
    }
  }
  EXPECT_GT(wrong, 0) << "no seed ran the consumer first";
}

// Without memory the detector still finds the missing wait, every
// operation is accepted on buffers far larger than the machine, and
// virtual time still passes.
TEST(SimDeviceTest, MetadataOnlyChecksAndTimesWithoutMemory) {
  SimDeviceOptions options;
  options.metadata_only = true;
  options.memory_bytes_per_second = 1e12;
  SimDeviceOps ops(options);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
  constexpr int64_t kCount = int64_t{1} << 38;  // 1 TiB of float32
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                 ops.Allocate(ops.device(), 4 * kCount));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer y,
                                 ops.Allocate(ops.device(), 4 * kCount));
  EXPECT_NE(x.data(), y.data());
  const BufferRef xs = x.As(DType::kFloat32), ys = y.As(DType::kFloat32);
  ASSERT_THAT(ops.SetStream(side), IsOk());
  ASSERT_THAT(ops.Fill(xs, 1), IsOk());
  ASSERT_THAT(ops.SetStream(Stream{0}), IsOk());
  ASSERT_THAT(ops.Copy(ys, xs), IsOk());
  ASSERT_THAT(ops.Kernel("forward", {ys}, {}, absl::Seconds(1)), IsOk());
  ASSERT_THAT(ops.Synchronize(), IsOk());
  ASSERT_EQ(ops.reports().size(), 1u);
  EXPECT_THAT(ops.reports()[0], HasSubstr("race: copy (stream 0, reads"));
  // The copy reads and writes 1 TiB each at 1e12 B/s (the racing fill runs
  // beside it on the other stream), then the kernel's second.
  EXPECT_NEAR(absl::ToDoubleSeconds(ops.HostNow()), 2.0 * 4 * kCount / 1e12 + 1,
              1e-6);
}

// A collective's slot in the vector clocks is reused once no access of it
// is recorded: a buffer read by ten thousand collectives in turn keeps a
// handful of slots, and the detector still finds a write racing with the
// last reader.
TEST(SimDeviceTest, CollectiveAgentsAreRecycledAndStillCaught) {
  SimDeviceOps ops;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                 ops.Allocate(ops.device(), 4 * 16));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer y,
                                 ops.Allocate(ops.device(), 4 * 16));
  const BufferRef xs = x.As(DType::kFloat32), ys = y.As(DType::kFloat32);
  ASSERT_THAT(ops.Fill(xs, 1), IsOk());
  ASSERT_THAT(ops.Synchronize(), IsOk());
  for (int i = 0; i < 10000; ++i) {
    const int64_t id = ops.CollectiveIssued("all_gather", xs, ys);
    ops.CollectiveDone(id);
    ops.CollectiveReleased(id);
  }
  EXPECT_LE(ops.clock_slots(), 8);
  EXPECT_THAT(ops.reports(), IsEmpty());
  // One more reader the host does not wait for, then a write on a stream.
  const int64_t last = ops.CollectiveIssued("all_gather", xs, ys);
  ASSERT_THAT(ops.SetStream(side), IsOk());
  ASSERT_THAT(ops.Fill(xs, 2), IsOk());
  ASSERT_THAT(ops.Synchronize(), IsOk());
  ASSERT_EQ(ops.reports().size(), 1u);
  EXPECT_THAT(ops.reports()[0],
              HasSubstr("is not ordered after all_gather #10000"));
  ops.CollectiveDone(last);
}

// A wait orders what the stream does next even when that is only an event
// (helper-found: an event recorded right after a wait, then synchronized,
// must cover the waited-for work).
TEST(SimDeviceTest, AnEventAfterAWaitCoversTheWaitedForWork) {
  for (uint64_t seed = 0; seed < 8; ++seed) {
    SimDeviceOps ops({seed});
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                   ops.Allocate(ops.device(), 16));
    ASSERT_THAT(ops.Fill(x.As(DType::kFloat32), 5), IsOk());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Event filled, ops.RecordEvent(Stream{0}));
    ASSERT_THAT(ops.WaitEvent(side, filled), IsOk());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Event after, ops.RecordEvent(side));
    ASSERT_THAT(ops.SynchronizeEvent(after), IsOk());
    const float* p = static_cast<const float*>(x.data());
    EXPECT_EQ(p[0], 5.0f) << seed;  // not the 0xFF fill (NaN)
    ops.HostAccess("host read", x.As(DType::kFloat32), /*write=*/false);
    EXPECT_THAT(ops.reports(), IsEmpty()) << seed;
  }
}

TEST(SimDeviceTest, HostSynchronizationOrdersToo) {
  SimDeviceOps ops;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                 ops.Allocate(ops.device(), 16));
  BufferRef xs = x.As(DType::kFloat32);
  ASSERT_THAT(ops.SetStream(side), IsOk());
  ASSERT_THAT(ops.Fill(xs, 2), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event e, ops.RecordEvent(side));
  // The host waits for the event, then issues on stream 0: ordered.
  ASSERT_THAT(ops.SynchronizeEvent(e), IsOk());
  ASSERT_THAT(ops.SetStream(Stream{0}), IsOk());
  ASSERT_THAT(ops.Scale(xs, ScaleOp::kMultiply, 2), IsOk());
  EXPECT_THAT(Read(ops, x), ElementsAre(4, 4, 4, 4));
  // The host reads after Synchronize: ordered; a host write racing with
  // queued work is not.
  ops.HostAccess("host read", xs, /*write=*/false);
  EXPECT_THAT(ops.reports(), IsEmpty());
  ASSERT_THAT(ops.SetStream(side), IsOk());
  ASSERT_THAT(ops.Fill(xs, 5), IsOk());
  ops.HostAccess("host write", xs, /*write=*/true);
  ASSERT_EQ(ops.reports().size(), 1u);
  EXPECT_THAT(ops.reports()[0],
              HasSubstr("race: host write (the host, writes"));
  ASSERT_THAT(ops.Synchronize(), IsOk());
}

TEST(SimDeviceTest, FreeingMemoryAnotherStreamUsesNeedsRecordStream) {
  for (bool record : {false, true}) {
    SimDeviceOps ops;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                   ops.Allocate(ops.device(), 16));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer y,
                                   ops.Allocate(ops.device(), 16));
    ASSERT_THAT(ops.Fill(x.As(DType::kFloat32), 1), IsOk());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Event filled, ops.RecordEvent(Stream{0}));
    ASSERT_THAT(ops.WaitEvent(side, filled), IsOk());
    ASSERT_THAT(ops.SetStream(side), IsOk());
    ASSERT_THAT(ops.Copy(y.As(DType::kFloat32), x.As(DType::kFloat32)), IsOk());
    ASSERT_THAT(ops.SetStream(Stream{0}), IsOk());
    if (record) {
      ASSERT_THAT(ops.RecordStream(x.As(DType::kFloat32), side), IsOk());
    }           // NOLINT
    x.Reset();  // allocated on stream 0; stream 1's copy may still read it
    if (record) {
      EXPECT_THAT(ops.reports(), IsEmpty());
    } else {
      ASSERT_EQ(ops.reports().size(), 1u);
      EXPECT_THAT(ops.reports()[0],
                  HasSubstr("freed while in use: copy (stream 1, reads"));
    }
    ASSERT_THAT(ops.Synchronize(), IsOk());
    EXPECT_THAT(Read(ops, y), ElementsAre(1, 1, 1, 1));
  }
}

// Memory comes from the allocating stream's pool at that stream's point:
// its previous owner's work there may still be queued. Another stream must
// be ordered after the allocation (an event recorded after it, or a host
// synchronization) before it touches the memory.
TEST(SimDeviceTest, AnotherStreamMustBeOrderedAfterTheAllocation) {
  for (int how : {0, 1, 2}) {  // no ordering, an event, a synchronization
    SimDeviceOps ops;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer old,
                                   ops.Allocate(ops.device(), 16));
    ASSERT_THAT(ops.Fill(old.As(DType::kFloat32), 1), IsOk());  // queued
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                   ops.Allocate(ops.device(), 16));
    if (how == 1) {
      FLATPARAM_ASSERT_OK_AND_ASSIGN(Event allocated,
                                     ops.RecordEvent(Stream{0}));
      ASSERT_THAT(ops.WaitEvent(side, allocated), IsOk());
    } else if (how == 2) {
      ASSERT_THAT(ops.Synchronize(), IsOk());
    }
    ASSERT_THAT(ops.SetStream(side), IsOk());
    ASSERT_THAT(ops.Fill(x.As(DType::kFloat32), 2), IsOk());
    ASSERT_THAT(ops.SetStream(Stream{0}), IsOk());
    if (how == 0) {
      ASSERT_EQ(ops.reports().size(), 1u);
      EXPECT_THAT(ops.reports()[0], HasSubstr("race: fill (stream 1, writes"));
      EXPECT_THAT(ops.reports()[0],
                  HasSubstr("is not ordered after its allocation (stream 0"));
    } else {
      EXPECT_THAT(ops.reports(), IsEmpty()) << how;
    }
    ASSERT_THAT(ops.Synchronize(), IsOk());
    EXPECT_THAT(Read(ops, x), ElementsAre(2, 2, 2, 2));
  }
}

TEST(SimDeviceTest, UseAfterFreeIsReported) {
  SimDeviceOps ops;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                 ops.Allocate(ops.device(), 16));
  const BufferRef dangling = x.As(DType::kFloat32);
  x.Reset();
  ASSERT_THAT(ops.Fill(dangling, 1), IsOk());
  ASSERT_EQ(ops.reports().size(), 1u);
  EXPECT_THAT(ops.reports()[0], HasSubstr("use after free: fill (stream 0"));
}

// A collective reads its input from issue to Wait: device work that writes
// the input must be ordered before the issue (the host synchronized), and
// work that reads the output after the Wait.
TEST(SimDeviceTest, CollectivesAreAgents) {
  for (bool sync : {true, false}) {
    SimOptions options;
    options.world_size = 2;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                   SimWorld::Create(options));
    std::vector<std::vector<std::string>> reports(2);
    std::vector<std::vector<float>> out(2);
    ASSERT_THAT(world->Run([&](Communicator& world_comm) -> absl::Status {
      SimDeviceOps ops;
      StreamCheckedCommunicator comm(&world_comm, &ops);
      FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer in,
                                 ops.Allocate(ops.device(), 8));
      FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer gathered,
                                 ops.Allocate(ops.device(), 16));
      FLATPARAM_RETURN_IF_ERROR(
          ops.Fill(in.As(DType::kFloat32), 1 + comm.rank()));
      if (sync) FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
      FLATPARAM_RETURN_IF_ERROR(comm.AllGather(in.As(DType::kFloat32),
                                               gathered.As(DType::kFloat32), {})
                                    ->Wait());
      FLATPARAM_RETURN_IF_ERROR(
          ops.Scale(gathered.As(DType::kFloat32), ScaleOp::kMultiply, 2));
      FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
      const float* p = static_cast<const float*>(gathered.data());
      out[comm.rank()].assign(p, p + 4);
      reports[comm.rank()] = ops.reports();
      return absl::OkStatus();
    }),
                IsOk());
    for (int r = 0; r < 2; ++r) {
      if (sync) {
        EXPECT_THAT(reports[r], IsEmpty());
        EXPECT_THAT(out[r], ElementsAre(2, 2, 4, 4));
      } else {
        ASSERT_EQ(reports[r].size(), 1u);
        EXPECT_THAT(reports[r][0],
                    HasSubstr("race: all_gather #0 (collective #0, reads"));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Virtual time.

TEST(SimDeviceTest, KernelsAndEventsOnTheVirtualClock) {
  for (uint64_t seed : {0, 1, 2}) {
    SimDeviceOps ops({seed});
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops.NewStream());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                   ops.Allocate(ops.device(), 16));
    const BufferRef xs = x.As(DType::kFloat32);
    // Stream 1: 10 us producing x; stream 0 waits, then 5 us reading it.
    ASSERT_THAT(ops.SetStream(side), IsOk());
    ASSERT_THAT(ops.Kernel("produce", {}, {xs}, absl::Microseconds(10),
                           [xs] { static_cast<float*>(xs.data)[0] = 1; }),
                IsOk());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Event produced, ops.RecordEvent(side));
    ASSERT_THAT(ops.SetStream(Stream{0}), IsOk());
    ASSERT_THAT(ops.WaitEvent(Stream{0}, produced), IsOk());
    ASSERT_THAT(ops.Kernel("consume", {xs}, {}, absl::Microseconds(5)), IsOk());
    // Also 3 us of independent work on stream 0 before nothing: it queues
    // behind the consumer.
    ASSERT_THAT(ops.Kernel("more", {}, {}, absl::Microseconds(3)), IsOk());
    // Nothing has run yet: the host's clock has not moved.
    EXPECT_EQ(ops.HostNow(), absl::ZeroDuration());
    ASSERT_THAT(ops.SynchronizeEvent(produced), IsOk());
    EXPECT_EQ(ops.HostNow(), absl::Microseconds(10));
    ASSERT_THAT(ops.Synchronize(), IsOk());
    EXPECT_EQ(ops.HostNow(), absl::Microseconds(18));
    EXPECT_EQ(ops.StreamBusy(side), absl::Microseconds(10));
    EXPECT_EQ(ops.StreamBusy(Stream{0}), absl::Microseconds(8));
    // Work issued now starts at the host's clock.
    ASSERT_THAT(ops.Kernel("late", {}, {}, absl::Microseconds(2)), IsOk());
    ASSERT_THAT(ops.Synchronize(), IsOk());
    EXPECT_EQ(ops.HostNow(), absl::Microseconds(20));
    EXPECT_THAT(ops.reports(), IsEmpty());
  }
}

TEST(SimDeviceTest, MemoryOperationsCostTheirBytes) {
  SimDeviceOptions options;
  options.memory_bytes_per_second = 1e9;  // 1 byte per ns
  SimDeviceOps ops(options);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer a,
                                 ops.Allocate(ops.device(), 4000));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer b,
                                 ops.Allocate(ops.device(), 4000));
  ASSERT_THAT(ops.Fill(a.As(DType::kFloat32), 1), IsOk());  // writes 4000
  ASSERT_THAT(ops.Copy(b.As(DType::kFloat32), a.As(DType::kFloat32)),
              IsOk());  // reads and writes 4000
  ASSERT_THAT(ops.Synchronize(), IsOk());
  EXPECT_EQ(ops.HostNow(), absl::Nanoseconds(12000));
  EXPECT_THAT(ops.Kernel("bad", {}, {}, -absl::Microseconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must be finite and non-negative")));
}

// Two ranks; each produces its all-gather input with a kernel on stream 1
// (rank r: 10 + 10 r us), issues the all-gather ordered after that stream
// (a simulated NCCL), makes stream 0 wait for it and reads the result
// there. The host never waits: its clock stays at zero until it
// synchronizes. The collective starts when the slower rank's stream is
// ready (20 us) and lasts 1 us; the reader's 5 us follow.
TEST(SimDeviceTest, StreamOrderedCollectivesOnTheVirtualClock) {
  for (bool order_input : {true, false}) {
    for (bool wait_output : {true, false}) {
      SimOptions options;
      options.world_size = 2;
      options.cost.latency = absl::Microseconds(1);
      options.cost.bytes_per_second = 1e18;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                     SimWorld::Create(options));
      std::vector<std::vector<std::string>> reports(2);
      std::vector<std::vector<float>> out(2);
      std::vector<absl::Duration> at_issue(2), at_end(2);
      ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
        SimRankClock clock(&comm);
        SimDeviceOptions device_options;
        device_options.host_clock = &clock;
        SimDeviceOps ops(device_options);
        StreamCheckedCommunicator checked(&comm, &ops, /*stream_ordered=*/true);
        if (!checked.SupportsStreams(ops.device()) ||
            checked.SupportsStreams(Device::Host())) {
          return absl::InternalError("SupportsStreams");
        }
        FLATPARAM_ASSIGN_OR_RETURN(Stream side, ops.NewStream());
        FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer in,
                                   ops.Allocate(ops.device(), 8));
        FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer gathered,
                                   ops.Allocate(ops.device(), 16));
        const BufferRef ins = in.As(DType::kFloat32);
        const BufferRef gs = gathered.As(DType::kFloat32);
        FLATPARAM_RETURN_IF_ERROR(ops.SetStream(side));
        const float value = 1.0f + comm.rank();
        FLATPARAM_RETURN_IF_ERROR(
            ops.Kernel("produce", {}, {ins},
                       absl::Microseconds(10 + 10 * comm.rank()), [ins, value] {
                         float* p = static_cast<float*>(ins.data);
                         for (int64_t i = 0; i < ins.count; ++i) p[i] = value;
                       }));
        FLATPARAM_RETURN_IF_ERROR(ops.SetStream(Stream{0}));
        CollectiveOptions co;
        if (order_input) co.stream = ops.NativeStream(side);
        std::unique_ptr<Work> work = checked.AllGather(ins, gs, co);
        at_issue[comm.rank()] = comm.Now();
        if (wait_output) {
          FLATPARAM_RETURN_IF_ERROR(
              work->WaitStream(*ops.NativeStream(Stream{0})));
        }
        FLATPARAM_RETURN_IF_ERROR(
            ops.Kernel("consume", {gs}, {}, absl::Microseconds(5)));
        FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
        at_end[comm.rank()] = comm.Now();
        FLATPARAM_RETURN_IF_ERROR(work->Wait());
        const float* p = static_cast<const float*>(gathered.data());
        out[comm.rank()].assign(p, p + 4);
        reports[comm.rank()] = ops.reports();
        return absl::OkStatus();
      }),
                  IsOk());
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(at_issue[r], absl::ZeroDuration()) << "the host waited";
        if (order_input && wait_output) {
          EXPECT_THAT(reports[r], IsEmpty());
          EXPECT_THAT(out[r], ElementsAre(1, 1, 2, 2));
          EXPECT_EQ(at_end[r], absl::Microseconds(26)) << r;
        } else {
          ASSERT_THAT(reports[r], Not(IsEmpty())) << order_input << wait_output;
          EXPECT_THAT(reports[r][0],
                      HasSubstr(order_input ? "race: consume (stream 0"
                                            : "race: all_gather #0"));
        }
      }
    }
  }
}

TEST(SimDeviceTest, StreamOrderedMisuseIsRejected) {
  SimOptions options;
  options.world_size = 1;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(options));
  ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
    SimDeviceOps ops, other;
    StreamCheckedCommunicator ordered(&comm, &ops, /*stream_ordered=*/true);
    StreamCheckedCommunicator host(&comm, &ops);
    FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer in, ops.Allocate(ops.device(), 8));
    FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer out, ops.Allocate(ops.device(), 8));
    const BufferRef ins = in.As(DType::kFloat32);
    const BufferRef outs = out.As(DType::kFloat32);
    CollectiveOptions co;
    co.stream = other.NativeStream(Stream{0});
    EXPECT_THAT(ordered.AllGather(ins, outs, co)->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("a stream of another device")));
    co.stream = DeviceStream{ops.device(), &ops, 7};
    EXPECT_THAT(ordered.AllGather(ins, outs, co)->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("stream 7, which these ops")));
    // A host-completed communicator ignores the stream and has no stream
    // waits, as a host backend.
    EXPECT_FALSE(host.SupportsStreams(ops.device()));
    co.stream = ops.NativeStream(Stream{0});
    std::unique_ptr<Work> work = host.AllGather(ins, outs, co);
    EXPECT_THAT(work->WaitStream(*ops.NativeStream(Stream{0})),
                StatusIs(absl::StatusCode::kUnimplemented));
    EXPECT_THAT(work->Wait(), IsOk());
    FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
    return absl::OkStatus();
  }),
              IsOk());
}

TEST(SimDeviceTest, StreamArgumentsAreChecked) {
  SimDeviceOps ops;
  EXPECT_THAT(ops.SetStream(Stream{1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("stream 1 was not created by these ops")));
  EXPECT_THAT(ops.WaitEvent(Stream{0}, Event{3, Stream{0}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("event 3 was not recorded")));
  // Native streams: the simulated ones name these ops; the host has none;
  // a stream nobody created has none either.
  const std::optional<DeviceStream> native = ops.NativeStream(Stream{0});
  ASSERT_TRUE(native.has_value());
  EXPECT_EQ(native->owner, &ops);
  EXPECT_EQ(native->device, Device::Cuda(0));
  EXPECT_FALSE(ops.NativeStream(Stream{1}).has_value());
  HostDeviceOps host;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream s, host.NewStream());
  EXPECT_EQ(s.id, 1);
  EXPECT_FALSE(host.NativeStream(s).has_value());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event e, host.RecordEvent(s));
  EXPECT_THAT(host.WaitEvent(Stream{0}, e), IsOk());
  EXPECT_THAT(host.SynchronizeEvent(e), IsOk());
}

}  // namespace
}  // namespace flatparam
