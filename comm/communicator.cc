#include "comm/communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace {

class DoneWork final : public Work {
 public:
  explicit DoneWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }
  // Already finished (or failed before it started): nothing to wait for.
  absl::Status WaitStream(const DeviceStream&) override {
    return absl::OkStatus();
  }

 private:
  absl::Status status_;
};

absl::Status CheckBuffer(int rank, absl::string_view op, int64_t seq,
                         absl::string_view which, ConstBufferRef b) {
  if (b.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d: %s #%d: %s has a negative count %d", rank, op,
                        seq, which, b.count));
  }
  if (b.count > 0 && b.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d: %s #%d: %s (%s) has a null pointer", rank, op,
                        seq, which, DescribeBuffer(b)));
  }
  if (!IsFloatingPoint(b.dtype)) {
    return absl::UnimplementedError(absl::StrFormat(
        "rank %d: %s #%d: %s has dtype %s; collectives take float32, "
        "float64, float16 or bfloat16",
        rank, op, seq, which, DTypeName(b.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckPair(int rank, absl::string_view op, int64_t seq,
                       ConstBufferRef input, ConstBufferRef output,
                       int64_t want_input, int64_t want_output) {
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer(rank, op, seq, "input", input));
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer(rank, op, seq, "output", output));
  if (input.dtype != output.dtype || input.device != output.device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: input (%s) and output (%s) differ in dtype or "
        "device",
        rank, op, seq, DescribeBuffer(input), DescribeBuffer(output)));
  }
  if (input.count != want_input || output.count != want_output) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: expected input of %d and output of %d elements, "
        "got %d and %d",
        rank, op, seq, want_input, want_output, input.count, output.count));
  }
  return absl::OkStatus();
}

absl::Status CheckReduceOptions(int rank, absl::string_view op, int64_t seq,
                                const ReduceOptions& options) {
  const bool divides =
      options.pre_divide_factor != 1.0 || options.post_divide_factor != 1.0;
  if (divides && options.op != ReduceOp::kSum && options.op != ReduceOp::kAvg) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: divide factors (%g, %g) need op sum or avg, got %s",
        rank, op, seq, options.pre_divide_factor, options.post_divide_factor,
        ReduceOpName(options.op)));
  }
  if (!(options.pre_divide_factor > 0) || !(options.post_divide_factor > 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: divide factors must be positive, got %g and %g", rank,
        op, seq, options.pre_divide_factor, options.post_divide_factor));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view CollectiveOpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather:
      return "all_gather";
    case CollectiveOp::kReduceScatter:
      return "reduce_scatter";
    case CollectiveOp::kAllReduce:
      return "all_reduce";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kAllGatherBytes:
      return "all_gather_bytes";
    case CollectiveOp::kBarrier:
      return "barrier";
    case CollectiveOp::kSplit:
      return "split";
  }
  return "unknown_op";
}

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "unknown";
}

absl::Status Work::WaitStream(const DeviceStream& stream) {
  return absl::UnimplementedError(absl::StrFormat(
      "WaitStream(%s): this backend completes collectives on the host; "
      "Wait() instead",
      DeviceName(stream.device)));
}

std::unique_ptr<Work> CompletedWork(absl::Status status) {
  return std::make_unique<DoneWork>(std::move(status));
}

absl::Status ValidateAllGather(int rank, int size, int64_t seq,
                               ConstBufferRef input, BufferRef output) {
  return CheckPair(rank, "all_gather", seq, input, output, input.count,
                   input.count * size);
}

absl::Status ValidateReduceScatter(int rank, int size, int64_t seq,
                                   ConstBufferRef input, BufferRef output,
                                   const ReduceOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(
      CheckReduceOptions(rank, "reduce_scatter", seq, options));
  return CheckPair(rank, "reduce_scatter", seq, input, output,
                   output.count * size, output.count);
}

absl::Status ValidateAllReduce(int rank, int size, int64_t seq,
                               ConstBufferRef input, BufferRef output,
                               const ReduceOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(
      CheckReduceOptions(rank, "all_reduce", seq, options));
  return CheckPair(rank, "all_reduce", seq, input, output, input.count,
                   input.count);
}

absl::Status ValidateBroadcast(int rank, int size, int64_t seq,
                               BufferRef buffer,
                               const BroadcastOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(
      CheckBuffer(rank, "broadcast", seq, "buffer", buffer));
  if (options.root < 0 || options.root >= size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d: broadcast #%d: root %d is not in [0, %d)",
                        rank, seq, options.root, size));
  }
  return absl::OkStatus();
}

absl::StatusOr<HybridGroups> MakeHybridGroups(
    Communicator& world, int shard_group_size,
    const CollectiveOptions& options) {
  if (shard_group_size < 1 || world.size() % shard_group_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard group size %d must be >= 1 and divide the world size %d",
        shard_group_size, world.size()));
  }
  const int node = world.rank() / shard_group_size;
  const int local = world.rank() % shard_group_size;
  HybridGroups groups;
  FLATPARAM_ASSIGN_OR_RETURN(groups.shard, world.Split(node, local, options));
  FLATPARAM_ASSIGN_OR_RETURN(groups.replicate,
                             world.Split(local, node, options));
  return groups;
}

}  // namespace flatparam
