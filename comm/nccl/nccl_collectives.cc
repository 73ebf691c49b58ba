#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/nccl/internal/nccl_internal.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"

// The data collectives of NcclCommunicator (AllGather, ReduceScatter,
// AllReduce, Broadcast): their argument checks (buffers, dtypes, divide
// factors), then one NCCL call each through Issue() (nccl_work.cc).
// internal/nccl_internal.h says how the backend's files fit together.

namespace flatparam {

using internal_nccl::AbortedError;
using internal_nccl::CommState;
using internal_nccl::Failed;
using internal_nccl::Issue;
using internal_nccl::ResolvedOp;

namespace {

ncclDataType_t NcclDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    default:
      // The Validate* functions reject every other dtype first.
      assert(false && "not a collective dtype");
      return ncclFloat32;
  }
}

std::string Describe(ConstBufferRef b) {
  return absl::StrFormat("%d x %s", b.count, DTypeName(b.dtype));
}

std::string OpContext(const CommState& s, absl::string_view op, int64_t seq,
                      ConstBufferRef input, ConstBufferRef output) {
  return absl::StrFormat("rank %d: %s #%d (input %s, output %s on cuda:%d)",
                         s.rank, op, seq, Describe(input), Describe(output),
                         s.device);
}

absl::StatusOr<ResolvedOp> ResolveOp(const CommState& s, absl::string_view op,
                                     int64_t seq, const ReduceOptions& options,
                                     DType dtype) {
  ResolvedOp resolved;
  resolved.dtype = NcclDType(dtype);
  const bool divides =
      options.pre_divide_factor != 1.0 || options.post_divide_factor != 1.0;
  switch (options.op) {
    case ReduceOp::kSum:
      resolved.builtin = ncclSum;
      break;
    case ReduceOp::kAvg:
      resolved.builtin = ncclAvg;
      break;
    case ReduceOp::kMax:
      resolved.builtin = ncclMax;
      return resolved;
    case ReduceOp::kMin:
      resolved.builtin = ncclMin;
      return resolved;
  }
  if (!divides) return resolved;
  double product = options.pre_divide_factor * options.post_divide_factor;
  if (options.op == ReduceOp::kAvg) product *= s.size;
  const double scale = 1.0 / product;
  StoreFromDouble(resolved.scalar, dtype, 0, scale);
  const double stored = LoadAsDouble(resolved.scalar, dtype, 0);
  if (!(stored > 0) || std::isinf(stored)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: divide factors %g and %g%s give the scale %g, "
        "which is %g in %s",
        s.rank, op, seq, options.pre_divide_factor, options.post_divide_factor,
        options.op == ReduceOp::kAvg
            ? absl::StrFormat(" and the group size %d", s.size)
            : std::string(),
        scale, stored, DTypeName(dtype)));
  }
  resolved.premul = true;
  return resolved;
}

// Host buffers are Unimplemented (NCCL reads device memory); a buffer of
// another device, or one whose memory is not what its label says, is
// InvalidArgument.
absl::Status CheckCudaBuffer(const CommState& s, absl::string_view op,
                             int64_t seq, absl::string_view which,
                             ConstBufferRef b) {
  if (b.device.type != DeviceType::kCuda) {
    return absl::UnimplementedError(absl::StrFormat(
        "rank %d: %s #%d: the NCCL backend takes CUDA buffers on cuda:%d; "
        "%s is %s on %s",
        s.rank, op, seq, s.device, which, Describe(b), DeviceName(b.device)));
  }
  if (b.device.index != s.device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: %s (%s) is on %s but this communicator's device is "
        "cuda:%d",
        s.rank, op, seq, which, Describe(b), DeviceName(b.device), s.device));
  }
  if (!s.options.check_pointers || b.count == 0) return absl::OkStatus();
  cudaPointerAttributes attributes;
  std::memset(&attributes, 0, sizeof(attributes));
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      *s.cuda, s.cuda->PointerGetAttributes(&attributes, b.data),
      absl::StrFormat("rank %d: %s #%d: cudaPointerGetAttributes(%s at %p)",
                      s.rank, op, seq, which, b.data)));
  if (attributes.type == cudaMemoryTypeManaged) return absl::OkStatus();
  if (attributes.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: %s (%s at %p) is labelled cuda:%d but is not device "
        "memory (cudaMemoryType %d)",
        s.rank, op, seq, which, Describe(b), b.data, s.device,
        static_cast<int>(attributes.type)));
  }
  if (attributes.device != s.device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: %s (%s at %p) is labelled cuda:%d but was "
        "allocated on cuda:%d",
        s.rank, op, seq, which, Describe(b), b.data, s.device,
        attributes.device));
  }
  return absl::OkStatus();
}

absl::Status CheckCudaPair(const CommState& s, absl::string_view op,
                           int64_t seq, ConstBufferRef input,
                           ConstBufferRef output, bool in_place) {
  FLATPARAM_RETURN_IF_ERROR(CheckCudaBuffer(s, op, seq, "input", input));
  FLATPARAM_RETURN_IF_ERROR(CheckCudaBuffer(s, op, seq, "output", output));
  if (!in_place && BuffersOverlap(input, output)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: input (%s at %p) and output (%s at %p) overlap but "
        "are not in place",
        s.rank, op, seq, Describe(input), input.data, Describe(output),
        output.data));
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Work> NcclCommunicator::AllGatherImpl(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "all_gather";
  if (absl::Status st = ValidateAllGather(s.rank, s.size, seq, input, output);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context = OpContext(s, kOp, seq, input, output);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  const bool in_place =
      input.data == static_cast<const char*>(output.data) +
                        static_cast<int64_t>(s.rank) * input.bytes();
  if (absl::Status st = CheckCudaPair(s, kOp, seq, input, output, in_place);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  if (input.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, nullptr,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t) {
                 return s.api->AllGather(input.data, output.data, input.count,
                                         NcclDType(input.dtype), comm, stream);
               });
}

std::unique_ptr<Work> NcclCommunicator::ReduceScatterImpl(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "reduce_scatter";
  if (absl::Status st =
          ValidateReduceScatter(s.rank, s.size, seq, input, output, options);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context = OpContext(s, kOp, seq, input, output);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  const bool in_place =
      output.data == static_cast<const char*>(input.data) +
                         static_cast<int64_t>(s.rank) * output.bytes();
  if (absl::Status st = CheckCudaPair(s, kOp, seq, input, output, in_place);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  absl::StatusOr<ResolvedOp> op = ResolveOp(s, kOp, seq, options, input.dtype);
  if (!op.ok()) return CompletedWork(op.status());
  if (output.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, &*op,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t redop) {
                 return s.api->ReduceScatter(
                     input.data, output.data, output.count,
                     NcclDType(input.dtype), redop, comm, stream);
               });
}

std::unique_ptr<Work> NcclCommunicator::AllReduceImpl(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "all_reduce";
  if (absl::Status st =
          ValidateAllReduce(s.rank, s.size, seq, input, output, options);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context = OpContext(s, kOp, seq, input, output);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  const bool in_place = input.data == output.data;
  if (absl::Status st = CheckCudaPair(s, kOp, seq, input, output, in_place);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  absl::StatusOr<ResolvedOp> op = ResolveOp(s, kOp, seq, options, input.dtype);
  if (!op.ok()) return CompletedWork(op.status());
  if (input.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, &*op,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t redop) {
                 return s.api->AllReduce(input.data, output.data, input.count,
                                         NcclDType(input.dtype), redop, comm,
                                         stream);
               });
}

std::unique_ptr<Work> NcclCommunicator::BroadcastImpl(
    BufferRef buffer, const BroadcastOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "broadcast";
  if (absl::Status st = ValidateBroadcast(s.rank, s.size, seq, buffer, options);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context =
      absl::StrFormat("rank %d: %s #%d (buffer %s on cuda:%d, root %d)", s.rank,
                      kOp, seq, Describe(buffer), s.device, options.root);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  if (absl::Status st = CheckCudaBuffer(s, kOp, seq, "buffer", buffer);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  if (buffer.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, nullptr,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t) {
                 return s.api->Broadcast(buffer.data, buffer.data, buffer.count,
                                         NcclDType(buffer.dtype), options.root,
                                         comm, stream);
               });
}

uint64_t NcclCommunicator::Record(CollectiveOp op, DType dtype, int64_t count,
                                  int64_t bytes) {
  if (recorder_ == nullptr) return 0;
  return recorder_->Enqueue(group_, seq_, op, dtype, count, bytes);
}

std::unique_ptr<Work> NcclCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  const uint64_t id =
      Record(CollectiveOp::kAllGather, input.dtype, input.count, input.bytes());
  return RecordedWork(AllGatherImpl(input, output, options), recorder_, id);
}

std::unique_ptr<Work> NcclCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const uint64_t id = Record(CollectiveOp::kReduceScatter, output.dtype,
                             output.count, input.bytes());
  return RecordedWork(ReduceScatterImpl(input, output, options), recorder_, id);
}

std::unique_ptr<Work> NcclCommunicator::AllReduce(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const uint64_t id =
      Record(CollectiveOp::kAllReduce, input.dtype, input.count, input.bytes());
  return RecordedWork(AllReduceImpl(input, output, options), recorder_, id);
}

std::unique_ptr<Work> NcclCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  const uint64_t id = Record(CollectiveOp::kBroadcast, buffer.dtype,
                             buffer.count, buffer.bytes());
  return RecordedWork(BroadcastImpl(buffer, options), recorder_, id);
}

}  // namespace flatparam
