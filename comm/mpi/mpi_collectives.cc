// The MPI backend's collectives: each builds an Op (its steps and the
// memory they use) and issues it with Launch (see "Algorithms" and
// "Memory" in DESIGN.md). Split, which makes a communicator, is in
// mpi_communicator.cc.
#include <mpi.h>

#include <cassert>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/host_reduce.h"
#include "comm/mpi/internal/mpi_internal.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {

using internal_mpi::Alloc;
using internal_mpi::BrokenError;
using internal_mpi::CommState;
using internal_mpi::CopyBytes;
using internal_mpi::DataHeader;
using internal_mpi::Engine;
using internal_mpi::Header;
using internal_mpi::Launch;
using internal_mpi::NonNull;
using internal_mpi::Op;
using internal_mpi::OpCode;
using internal_mpi::OpInfo;
using internal_mpi::OpMemory;
using internal_mpi::ReduceHeader;
using internal_mpi::Requests;
using internal_mpi::StageIn;
using internal_mpi::StageOut;
using internal_mpi::Step;

namespace {

// all_reduce gathers every rank's whole input and folds it locally (one
// collective) up to this many gathered bytes, and reduces chunks with an
// all-to-all and an all-gather (two collectives, less data) above.
constexpr int64_t kSmallAllReduceBytes = int64_t{64} << 10;

MPI_Datatype ElementType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return MPI_FLOAT;
    case DType::kFloat64:
      return MPI_DOUBLE;
    default:
      // float16 and bfloat16: MPI only moves them; HostReduce does the math.
      assert(DTypeSize(dtype) == 2);
      return MPI_UINT16_T;
  }
}

// The tag of the point-to-point messages of PostExchange. MPI delivers the
// messages between two ranks with one tag and communicator in the order they
// were sent, and every rank posts its exchanges in the collectives' issue
// order, so the k-th exchange's messages always meet the k-th exchange's
// receives. (Collectives' own traffic is in a separate context.)
constexpr int kExchangeTag = 0x464c;

// Posts a linear exchange with every other rank: receives (first, so that
// messages land in place rather than in MPI's unexpected queue) from the
// ranks below, nearest first, then sends to the ranks above, nearest first,
// so that the ranks do not all send to the same peer at once. `recv(r)` and
// `send(r)` return rank r's block as {pointer, element count}. Appends the
// requests; returns the first error's code.
template <typename RecvBlock, typename SendBlock>
int PostExchange(const OpMemory& m, RecvBlock recv, SendBlock send,
                 Requests* requests) {
  requests->reserve(requests->size() + 2 * (m.size - 1));
  for (int k = 1; k < m.size; ++k) {
    const int r = (m.rank - k + m.size) % m.size;
    const auto [data, count] = recv(r);
    requests->push_back(MPI_REQUEST_NULL);
    const int rc = MPI_Irecv(data, count, m.type, r, kExchangeTag, m.comm,
                             &requests->back());
    if (rc != MPI_SUCCESS) return rc;
  }
  for (int k = 1; k < m.size; ++k) {
    const int r = (m.rank + k) % m.size;
    const auto [data, count] = send(r);
    requests->push_back(MPI_REQUEST_NULL);
    const int rc = MPI_Isend(data, count, m.type, r, kExchangeTag, m.comm,
                             &requests->back());
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

// A step of point-to-point operations (PostExchange).
Step ExchangeStep(const char* call, std::function<int(Requests*)> post,
                  std::function<absl::Status()> finish) {
  return {call, nullptr, std::move(finish), std::move(post), true};
}

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<Op> op, FlightRecorder* recorder)
      : op_(std::move(op)), recorder_(recorder) {}

  // Waiting here keeps every rank's collectives completing even when a
  // caller drops a Work without waiting on it.
  ~MpiWork() override { Wait().IgnoreError(); }

  absl::Status Wait() override {
    if (op_ != nullptr) {
      status_ = Engine::Get().Wait(*op_);
      // The engine marked a success when it happened; a failure is marked
      // here, on the rank's thread, where dumping the ring blocks nothing.
      if (recorder_ != nullptr) recorder_->Finished(op_->flight_id, status_);
      op_.reset();
    }
    return status_;
  }

 private:
  std::shared_ptr<Op> op_;
  FlightRecorder* recorder_;  // Owned by the op's CommState.
  absl::Status status_;
};

// The MPI backend's own limits, after the shared validation passed.
absl::Status CheckMpiLimits(const OpInfo& info, Device device,
                            int64_t per_rank_count) {
  if (device.type != DeviceType::kHost) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: buffers on %s; the MPI backend takes host buffers only",
        info.Describe(), DeviceName(device)));
  }
  if (per_rank_count > INT_MAX) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: %d elements per rank exceed MPI's int count limit %d",
        info.Describe(), per_rank_count, INT_MAX));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal_mpi {

std::unique_ptr<Work> Launch(const std::shared_ptr<CommState>& state,
                             const OpInfo& info, absl::Duration timeout,
                             const absl::Status& valid, const Header& header,
                             bool check, const Plan& plan) {
  FlightRecorder* recorder = state->recorder.get();
  uint64_t flight_id = 0;
  if (recorder != nullptr) {
    const bool bytes_only = info.code == OpCode::kAllGatherBytes;
    const int64_t count = bytes_only ? info.input_count : header.count;
    const int64_t bytes =
        bytes_only
            ? info.input_count
            : (info.buffers > 0 ? info.input_count * DTypeSize(info.input_dtype)
                                : 0);
    flight_id = recorder->Enqueue(state->group, info.seq, info.code,
                                  info.input_dtype, count, bytes);
  }
  if (state->is_broken.load(std::memory_order_acquire)) {
    absl::Status broken =
        BrokenError(Engine::Get().Health(*state), info.Describe());
    if (recorder != nullptr) recorder->Finished(flight_id, broken);
    return CompletedWork(std::move(broken));
  }
  if (!check && !valid.ok()) {
    if (recorder != nullptr) recorder->Finished(flight_id, valid);
    return CompletedWork(valid);
  }
  // A checked call carries its FSDP context, so that ranks issuing the
  // same sizes from different units disagree here already.
  Header checked = header;
  OpInfo described = info;
  if (check && recorder != nullptr) {
    const CollectiveContext context = recorder->context();
    checked.context = ContextHash(context);
    described.context = DescribeContext(context);
  }
  auto op = std::make_shared<Op>(state, std::move(described), timeout);
  op->flight_id = flight_id;
  op->memory.comm = state->comm;
  op->memory.rank = state->rank;
  op->memory.size = state->size;
  if (check) {
    op->steps.push_back(
        HeaderStep(*state, op->info, checked, valid, &op->memory));
  }
  if (valid.ok() && plan) plan(*op);
  Engine::Get().Submit(op);
  // The op owns the caller's buffers now, and this thread returns the Work
  // only after the copy, so no Wait() can return before it.
  CopyBytes(op->own_block.dst, op->own_block.src, op->own_block.bytes);
  return std::make_unique<MpiWork>(std::move(op), recorder);
}

}  // namespace internal_mpi

std::unique_ptr<Work> MpiCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  const CommState& st = *state_;
  const OpInfo info = OpInfo::Pair(st.rank, OpCode::kAllGather,
                                   state_->next_seq++, input, output);
  absl::Status valid =
      ValidateAllGather(st.rank, st.size, info.seq, input, output);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, input.count);
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid,
      DataHeader(info, input.count, input.dtype), st.options.check_collectives,
      [&](Op& op) {
        OpMemory* m = &op.memory;
        m->n = static_cast<int>(input.count);
        m->type = ElementType(input.dtype);
        m->bytes = input.bytes();
        m->user_out = output.data;
        char* out = static_cast<char*>(NonNull(output.data));
        const void* in = NonNull(input.data);
        const bool in_place = input.data == out + m->rank * m->bytes;
        if (stage) {
          m->send = StageIn(input.data, m->bytes);
          m->recv = Alloc(m->bytes * m->size);
          in = m->send.get();
          out = m->recv.get();
        } else if (!in_place && BytesOverlap(input.data, m->bytes, out,
                                             m->bytes * m->size)) {
          // The sends read the input while the receives write the output.
          m->send = StageIn(input.data, m->bytes);
          in = m->send.get();
        }
        m->in = in;
        m->out = out;
        // This rank's own block: zero-copy, copied into the caller's output
        // once the exchange is posted (so that the copy overlaps it; nothing
        // else writes that block); staged, before (the finish copies the
        // whole staging buffer out, possibly on the progress thread).
        if (!in_place || stage) {
          char* const own = out + m->rank * m->bytes;
          if (stage) {
            CopyBytes(own, in, m->bytes);
          } else {
            op.own_block = {own, in, m->bytes};
          }
        }
        op.zero_copy = !stage;
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-gather)",
            [m](Requests* requests) {
              char* const out = static_cast<char*>(m->out);
              return PostExchange(
                  *m,
                  [m, out](int r) {
                    return std::pair<void*, int>(out + r * m->bytes, m->n);
                  },
                  [m](int) { return std::pair<const void*, int>(m->in, m->n); },
                  requests);
            },
            stage ? std::function<absl::Status()>([m]() {
              StageOut(m->user_out, m->out, m->bytes * m->size);
              return absl::OkStatus();
            })
                  : nullptr));
      });
}

std::unique_ptr<Work> MpiCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const CommState& st = *state_;
  const OpInfo info = OpInfo::Pair(st.rank, OpCode::kReduceScatter,
                                   state_->next_seq++, input, output);
  absl::Status valid =
      ValidateReduceScatter(st.rank, st.size, info.seq, input, output, options);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, output.count);
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid,
      ReduceHeader(info, output.count, output.dtype, options),
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        m->n = static_cast<int>(output.count);
        m->type = ElementType(input.dtype);
        m->dtype = input.dtype;
        m->bytes = output.bytes();  // One slice.
        m->reduce = options;
        m->user_out = output.data;
        // Zero-copy, the sends read the caller's input. It is not read
        // after the exchange completes and the output is not written
        // before, so they may overlap (in place included).
        const char* in = static_cast<const char*>(NonNull(input.data));
        if (stage) {
          m->send = StageIn(input.data, input.bytes());
          in = m->send.get();
        } else {
          op.zero_copy = true;
        }
        m->in = in;
        // Slice rank() of every other rank, in rank order, to fold.
        m->recv = Alloc(input.bytes());
        // This rank's own slice is folded from the input where it is,
        // unless the fold's output overlaps it (in place): then from a copy.
        const char* own = in + m->rank * m->bytes;
        m->own_copied = BytesOverlap(output.data, m->bytes, own, m->bytes);
        if (m->own_copied) {
          CopyBytes(m->recv.get() + m->rank * m->bytes, own, m->bytes);
        }
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-to-all)",
            [m](Requests* requests) {
              const char* const in = static_cast<const char*>(m->in);
              char* const recv = m->recv.get();
              return PostExchange(
                  *m,
                  [m, recv](int r) {
                    return std::pair<void*, int>(recv + r * m->bytes, m->n);
                  },
                  [m, in](int r) {
                    return std::pair<const void*, int>(in + r * m->bytes, m->n);
                  },
                  requests);
            },
            [m]() {
              // Straight into the caller's output (staged too: this runs
              // before Wait() returns), in rank order.
              for (int r = 0; r < m->size; ++r) {
                const char* x =
                    r == m->rank && !m->own_copied
                        ? static_cast<const char*>(m->in) + r * m->bytes
                        : m->recv.get() + r * m->bytes;
                HostReduceStep(m->user_out, x, m->n, m->dtype, m->reduce,
                               r == 0);
              }
              HostReduceFinish(m->user_out, m->n, m->dtype, m->reduce, m->size);
              return absl::OkStatus();
            }));
      });
}

std::unique_ptr<Work> MpiCommunicator::AllReduce(ConstBufferRef input,
                                                 BufferRef output,
                                                 const ReduceOptions& options) {
  const CommState& st = *state_;
  const OpInfo info = OpInfo::Pair(st.rank, OpCode::kAllReduce,
                                   state_->next_seq++, input, output);
  absl::Status valid =
      ValidateAllReduce(st.rank, st.size, info.seq, input, output, options);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, input.count);
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid,
      ReduceHeader(info, input.count, input.dtype, options),
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        const int size = m->size;
        const int rank = m->rank;
        const int64_t elem = DTypeSize(input.dtype);
        const int64_t bytes = input.bytes();
        m->type = ElementType(input.dtype);
        m->dtype = input.dtype;
        m->reduce = options;
        m->user_out = output.data;
        m->bytes = bytes;
        // Zero-copy, the sends read the caller's input and the results go
        // straight into its output. The input is not read after the first
        // exchange completes and the output not written before, so they
        // may overlap (in place included).
        const char* in = static_cast<const char*>(NonNull(input.data));
        if (stage) {
          m->send = StageIn(input.data, bytes);
          in = m->send.get();
        } else {
          op.zero_copy = true;
        }
        m->in = in;
        if (bytes * size <= kSmallAllReduceBytes) {
          // Small: every rank receives every input and folds the whole
          // buffer, in rank order (the same fold, element by element, as
          // the chunked algorithm below, so the same bits): one exchange
          // instead of two, as latency dominates at this size. The fold
          // writes the caller's output before Wait() returns, staged too.
          m->n = static_cast<int>(input.count);
          m->recv = Alloc(bytes * size);
          m->own_copied = BytesOverlap(output.data, bytes, in, bytes);
          if (m->own_copied) CopyBytes(m->recv.get() + rank * bytes, in, bytes);
          op.steps.push_back(ExchangeStep(
              "MPI_Isend/MPI_Irecv (all-gather of the inputs)",
              [m](Requests* requests) {
                char* const recv = m->recv.get();
                return PostExchange(
                    *m,
                    [m, recv](int r) {
                      return std::pair<void*, int>(recv + r * m->bytes, m->n);
                    },
                    [m](int) {
                      return std::pair<const void*, int>(m->in, m->n);
                    },
                    requests);
              },
              [m]() {
                for (int r = 0; r < m->size; ++r) {
                  const void* x = r == m->rank && !m->own_copied
                                      ? m->in
                                      : m->recv.get() + r * m->bytes;
                  HostReduceStep(m->user_out, x, m->n, m->dtype, m->reduce,
                                 r == 0);
                }
                HostReduceFinish(m->user_out, m->n, m->dtype, m->reduce,
                                 m->size);
                return absl::OkStatus();
              }));
          return;
        }
        // Rank i reduces chunk i: the first count % size chunks have one
        // element more. Staged, the chunks are reduced and gathered in a
        // staging buffer, copied out at the end.
        const int n = static_cast<int>(input.count);
        m->counts.resize(size);
        m->displs.resize(size);
        for (int r = 0, offset = 0; r < size; ++r) {
          m->counts[r] = n / size + (r < n % size ? 1 : 0);
          m->displs[r] = offset;
          offset += m->counts[r];
        }
        m->n = m->counts[rank];
        const int64_t chunk_bytes = static_cast<int64_t>(m->n) * elem;
        m->recv = Alloc(chunk_bytes * size);
        if (stage) {
          m->acc = Alloc(bytes);
          m->out = m->acc.get();
        } else {
          m->out = NonNull(output.data);
        }
        const char* own_in = in + static_cast<int64_t>(m->displs[rank]) * elem;
        char* own_out = static_cast<char*>(m->out) +
                        static_cast<int64_t>(m->displs[rank]) * elem;
        m->own_copied = BytesOverlap(own_out, chunk_bytes, own_in, chunk_bytes);
        if (m->own_copied) {
          CopyBytes(m->recv.get() + rank * chunk_bytes, own_in, chunk_bytes);
        }
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-to-all of the chunks)",
            [m](Requests* requests) {
              const int64_t elem = DTypeSize(m->dtype);
              const char* const in = static_cast<const char*>(m->in);
              char* const recv = m->recv.get();
              return PostExchange(
                  *m,
                  [m, recv, elem](int r) {
                    return std::pair<void*, int>(recv + r * m->n * elem, m->n);
                  },
                  [m, in, elem](int r) {
                    return std::pair<const void*, int>(
                        in + static_cast<int64_t>(m->displs[r]) * elem,
                        m->counts[r]);
                  },
                  requests);
            },
            [m]() {
              const int64_t elem = DTypeSize(m->dtype);
              const int64_t chunk_bytes = static_cast<int64_t>(m->n) * elem;
              const int64_t offset =
                  static_cast<int64_t>(m->displs[m->rank]) * elem;
              char* const acc = static_cast<char*>(m->out) + offset;
              for (int r = 0; r < m->size; ++r) {
                const char* x = r == m->rank && !m->own_copied
                                    ? static_cast<const char*>(m->in) + offset
                                    : m->recv.get() + r * chunk_bytes;
                HostReduceStep(acc, x, m->n, m->dtype, m->reduce, r == 0);
              }
              HostReduceFinish(acc, m->n, m->dtype, m->reduce, m->size);
              return absl::OkStatus();
            }));
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-gather of the chunks)",
            [m](Requests* requests) {
              const int64_t elem = DTypeSize(m->dtype);
              char* const out = static_cast<char*>(m->out);
              const char* own =
                  out + static_cast<int64_t>(m->displs[m->rank]) * elem;
              return PostExchange(
                  *m,
                  [m, out, elem](int r) {
                    return std::pair<void*, int>(
                        out + static_cast<int64_t>(m->displs[r]) * elem,
                        m->counts[r]);
                  },
                  [m, own](int) {
                    return std::pair<const void*, int>(own, m->n);
                  },
                  requests);
            },
            stage ? std::function<absl::Status()>([m]() {
              StageOut(m->user_out, m->out, m->bytes);
              return absl::OkStatus();
            })
                  : nullptr));
      });
}

std::unique_ptr<Work> MpiCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  const CommState& st = *state_;
  OpInfo info{st.rank, OpCode::kBroadcast, state_->next_seq++};
  info.buffers = 1;
  info.input_count = buffer.count;
  info.input_dtype = buffer.dtype;
  info.root = options.root;
  absl::Status valid =
      ValidateBroadcast(st.rank, st.size, info.seq, buffer, options);
  if (valid.ok()) valid = CheckMpiLimits(info, buffer.device, buffer.count);
  Header header = DataHeader(info, buffer.count, buffer.dtype);
  header.root = options.root;
  const bool is_root = options.root == st.rank;
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid, header,
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        m->n = static_cast<int>(buffer.count);
        m->type = ElementType(buffer.dtype);
        m->bytes = buffer.bytes();
        m->root = options.root;
        m->is_root = is_root;
        m->user_out = buffer.data;
        if (stage) {
          m->send = is_root ? StageIn(buffer.data, m->bytes) : Alloc(m->bytes);
          m->out = m->send.get();
        } else {
          m->out = NonNull(buffer.data);
          op.zero_copy = true;
        }
        op.steps.push_back({"MPI_Ibcast",
                            [m](MPI_Request* request) {
                              return MPI_Ibcast(m->out, m->n, m->type, m->root,
                                                m->comm, request);
                            },
                            stage ? std::function<absl::Status()>([m]() {
                              if (!m->is_root)
                                StageOut(m->user_out, m->out, m->bytes);
                              return absl::OkStatus();
                            })
                                  : nullptr});
      });
}

absl::StatusOr<std::vector<std::string>> MpiCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  const CommState& st = *state_;
  OpInfo info{st.rank, OpCode::kAllGatherBytes, state_->next_seq++,
              absl::StrFormat("%d bytes", bytes.size())};
  info.input_count = static_cast<int64_t>(bytes.size());
  Header header;
  header.seq = info.seq;
  header.op = static_cast<int32_t>(info.code);
  header.pre_divide = header.post_divide = 1.0;
  const int size = st.size;
  std::vector<std::string> result;
  std::vector<std::string>* out = &result;
  // Lengths are checked after they are exchanged, so that every rank fails
  // alike instead of one failing and the others timing out. The string is
  // always copied (metadata, small): this call returns even after a
  // timeout, when MPI may still read it.
  std::unique_ptr<Work> work = Launch(
      state_, info, options.timeout, absl::OkStatus(), header,
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        m->length = static_cast<int64_t>(bytes.size());
        m->lengths.resize(size);
        m->send = Alloc(m->length);
        CopyBytes(m->send.get(), bytes.data(), m->length);
        m->lengths[m->rank] = m->length;
        // Point-to-point exchanges, as the data collectives, so that a
        // timeout names the ranks whose part never came.
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (lengths)",
            [m](Requests* requests) {
              m->type = MPI_INT64_T;
              return PostExchange(
                  *m,
                  [m](int r) {
                    return std::pair<void*, int>(&m->lengths[r], 1);
                  },
                  [m](int) {
                    return std::pair<const void*, int>(&m->length, 1);
                  },
                  requests);
            },
            [=]() {
              int64_t total = 0;
              for (int64_t length : m->lengths) total += length;
              if (total > INT_MAX) {
                return absl::UnimplementedError(absl::StrFormat(
                    "%s: the ranks' strings total %d bytes (lengths %s), "
                    "over MPI's int count limit %d",
                    info.Describe(), total, absl::StrJoin(m->lengths, ","),
                    INT_MAX));
              }
              m->counts.resize(size);
              m->displs.resize(size);
              for (int r = 0, offset = 0; r < size; ++r) {
                m->counts[r] = static_cast<int>(m->lengths[r]);
                m->displs[r] = offset;
                offset += m->counts[r];
              }
              m->recv = Alloc(total);
              CopyBytes(m->recv.get() + m->displs[m->rank], m->send.get(),
                        m->length);
              return absl::OkStatus();
            }));
        // `out` is written before Wait() below returns OK; after a
        // timeout this step's finish never runs.
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (strings)",
            [m](Requests* requests) {
              m->type = MPI_BYTE;
              return PostExchange(
                  *m,
                  [m](int r) {
                    return std::pair<void*, int>(m->recv.get() + m->displs[r],
                                                 m->counts[r]);
                  },
                  [m](int) {
                    return std::pair<const void*, int>(
                        m->send.get(), static_cast<int>(m->length));
                  },
                  requests);
            },
            [=]() {
              out->clear();
              for (int r = 0; r < size; ++r) {
                out->emplace_back(m->recv.get() + m->displs[r], m->counts[r]);
              }
              return absl::OkStatus();
            }));
      });
  FLATPARAM_RETURN_IF_ERROR(work->Wait());
  return result;
}

absl::Status MpiCommunicator::Barrier(const CollectiveOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{st.rank, OpCode::kBarrier, state_->next_seq++, ""};
  Header header;
  header.seq = info.seq;
  header.op = static_cast<int32_t>(info.code);
  header.pre_divide = header.post_divide = 1.0;
  const MPI_Comm comm = st.comm;
  return Launch(state_, info, options.timeout, absl::OkStatus(), header,
                st.options.check_collectives,
                [&](Op& op) {
                  op.steps.push_back({"MPI_Ibarrier",
                                      [=](MPI_Request* request) {
                                        return MPI_Ibarrier(comm, request);
                                      },
                                      nullptr});
                })
      ->Wait();
}

}  // namespace flatparam
