// FakeNcclApi's NCCL calls and controls; its CUDA runtime model is in
// fake_nccl_api_cuda.cc.
#include "comm/nccl/fake_nccl_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/nccl/internal/fake_nccl_api_internal.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

using internal_fake_nccl::CurrentDevice;
using internal_fake_nccl::Find;

FakeNcclApi::FakeNcclApi(int device_count) : device_count_(device_count) {
  CurrentDevice() = 0;
}

FakeNcclApi::~FakeNcclApi() = default;

void FakeNcclApi::set_device_count_error(cudaError_t error) {
  absl::MutexLock lock(&mu_);
  device_count_error_ = error;
}

void FakeNcclApi::FailNext(absl::string_view name, int code) {
  absl::MutexLock lock(&mu_);
  fail_next_[std::string(name)] = code;
}

void FakeNcclApi::set_in_progress_polls(int polls) {
  absl::MutexLock lock(&mu_);
  in_progress_polls_ = polls;
}

void FakeNcclApi::SetAsyncError(ncclResult_t error) {
  absl::MutexLock lock(&mu_);
  async_error_ = error;
}

void FakeNcclApi::set_event_pending_queries(int queries) {
  absl::MutexLock lock(&mu_);
  event_pending_queries_ = queries;
}

void FakeNcclApi::SetNextSplit(int nranks, int rank) {
  absl::MutexLock lock(&mu_);
  next_split_set_ = true;
  next_split_nranks_ = nranks;
  next_split_rank_ = rank;
}

void FakeNcclApi::set_last_error(std::string text) {
  absl::MutexLock lock(&mu_);
  last_error_ = std::move(text);
}

std::vector<std::string> FakeNcclApi::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

int FakeNcclApi::CallCount(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(std::count(calls_.begin(), calls_.end(), name));
}

std::vector<FakeNcclApi::Collective> FakeNcclApi::collectives() const {
  absl::MutexLock lock(&mu_);
  return collectives_;
}

std::vector<FakeNcclApi::PreMulSum> FakeNcclApi::premul_ops() const {
  absl::MutexLock lock(&mu_);
  return premul_ops_;
}

std::vector<FakeNcclApi::CommInfo> FakeNcclApi::comms() const {
  absl::MutexLock lock(&mu_);
  std::vector<CommInfo> infos;
  for (const auto& comm : comms_) infos.push_back(comm->info);
  return infos;
}

FakeNcclApi::CommInfo FakeNcclApi::comm_info(ncclComm_t comm) const {
  absl::MutexLock lock(&mu_);
  const Comm* c = Find(comms_, comm);
  return c == nullptr ? CommInfo() : c->info;
}

std::vector<FakeNcclApi::StreamWait> FakeNcclApi::stream_waits() const {
  absl::MutexLock lock(&mu_);
  return stream_waits_;
}

std::vector<FakeNcclApi::Stream> FakeNcclApi::streams() const {
  absl::MutexLock lock(&mu_);
  std::vector<Stream> result;
  for (const auto& stream : streams_) result.push_back(*stream);
  return result;
}

std::vector<std::string> FakeNcclApi::misuse() const {
  absl::MutexLock lock(&mu_);
  return misuse_;
}

int FakeNcclApi::live_events() const {
  absl::MutexLock lock(&mu_);
  int live = 0;
  for (const auto& event : events_) live += event->destroyed ? 0 : 1;
  return live;
}

int FakeNcclApi::pageable_copies() const {
  absl::MutexLock lock(&mu_);
  return pageable_copies_;
}

bool FakeNcclApi::IsPinned(const void* ptr, size_t bytes) const {
  const char* p = static_cast<const char*>(ptr);
  auto it = pinned_.upper_bound(p);
  if (it == pinned_.begin()) return false;
  --it;
  return p + bytes <= it->first + it->second.size();
}

int FakeNcclApi::live_allocations() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(allocations_.size());
}

void FakeNcclApi::Misuse(std::string what) {
  misuse_.push_back(std::move(what));
}

bool FakeNcclApi::Begin(absl::string_view name, int* code) {
  calls_.emplace_back(name);
  auto it = fail_next_.find(std::string(name));
  if (it == fail_next_.end()) return false;
  *code = it->second;
  fail_next_.erase(it);
  return true;
}

FakeNcclApi::Comm* FakeNcclApi::LiveComm(ncclComm_t comm,
                                         absl::string_view call,
                                         bool allow_in_progress) {
  Comm* c = Find(comms_, comm);
  if (c == nullptr) {
    Misuse(absl::StrFormat("%s on an unknown communicator %p", call, comm));
    return nullptr;
  }
  if (c->info.destroyed || c->info.aborted) {
    Misuse(
        absl::StrFormat("%s on communicator %p after %s", call, comm,
                        c->info.aborted ? "ncclCommAbort" : "ncclCommDestroy"));
    return nullptr;
  }
  if (c->pending_polls != 0 && !allow_in_progress) {
    Misuse(absl::StrFormat("%s on communicator %p while it is ncclInProgress",
                           call, comm));
  }
  return c;
}

ncclResult_t FakeNcclApi::Finish(Comm& comm) {
  if (comm.info.blocking || in_progress_polls_ == 0) return ncclSuccess;
  comm.pending_polls = in_progress_polls_;
  return ncclInProgress;
}

bool FakeNcclApi::CheckDeviceRange(const void* ptr, size_t bytes,
                                   absl::string_view what) {
  const char* p = static_cast<const char*>(ptr);
  auto it = allocations_.upper_bound(p);
  if (it != allocations_.begin()) {
    --it;
    const char* base = it->first;
    if (p >= base && p + bytes <= base + it->second.bytes.size()) return true;
  }
  Misuse(absl::StrFormat("%s: [%p, +%d bytes) is not fake device memory", what,
                         ptr, bytes));
  return false;
}

bool FakeNcclApi::CheckStream(cudaStream_t stream, const Comm& comm,
                              absl::string_view call) {
  const Stream* s = Find(streams_, stream);
  if (s == nullptr || s->destroyed) {
    Misuse(absl::StrFormat("%s on an unknown or destroyed stream %p", call,
                           stream));
    return false;
  }
  if (s->device != comm.info.device) {
    Misuse(absl::StrFormat("%s: stream of cuda:%d, communicator of cuda:%d",
                           call, s->device, comm.info.device));
    return false;
  }
  return true;
}

ncclResult_t FakeNcclApi::GetVersion(int* version) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclGetVersion", &code)) return static_cast<ncclResult_t>(code);
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::GetUniqueId(ncclUniqueId* id) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclGetUniqueId", &code)) return static_cast<ncclResult_t>(code);
  std::memset(id, 0, sizeof(*id));
  const std::string text = absl::StrCat("fake-unique-id-", ++unique_ids_);
  std::memcpy(id->internal, text.data(), text.size());
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::CommInitRankConfig(ncclComm_t* comm, int nranks,
                                             ncclUniqueId id, int rank,
                                             ncclConfig_t* config) {
  absl::MutexLock lock(&mu_);
  *comm = nullptr;
  int code = 0;
  if (Begin("ncclCommInitRankConfig", &code)) {
    return static_cast<ncclResult_t>(code);
  }
  bool blocking = true;
  if (config != nullptr) {
    if (config->magic != 0xcafebeef || config->size != sizeof(ncclConfig_t)) {
      Misuse("ncclCommInitRankConfig: config not from NCCL_CONFIG_INITIALIZER");
    }
    blocking = config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking;
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  auto c = std::make_unique<Comm>();
  c->info.nranks = nranks;
  c->info.rank = rank;
  c->info.device = CurrentDevice();
  c->info.blocking = blocking;
  c->info.unique_id = std::string(id.internal, sizeof(id.internal));
  *comm = reinterpret_cast<ncclComm_t>(c.get());
  comms_.push_back(std::move(c));
  return Finish(*comms_.back());
}

ncclResult_t FakeNcclApi::CommSplit(ncclComm_t comm, int color, int key,
                                    ncclComm_t* newcomm, ncclConfig_t* config) {
  absl::MutexLock lock(&mu_);
  *newcomm = nullptr;
  int code = 0;
  if (Begin("ncclCommSplit", &code)) return static_cast<ncclResult_t>(code);
  Comm* parent = LiveComm(comm, "ncclCommSplit");
  if (parent == nullptr) return ncclInvalidUsage;
  if (color != NCCL_SPLIT_NOCOLOR) {
    if (color < 0) return ncclInvalidArgument;
    auto c = std::make_unique<Comm>();
    c->info = CommInfo();
    c->info.nranks = next_split_set_ ? next_split_nranks_ : parent->info.nranks;
    c->info.rank = next_split_set_ ? next_split_rank_ : parent->info.rank;
    c->info.device = parent->info.device;
    c->info.blocking =
        config == nullptr ? parent->info.blocking : config->blocking != 0;
    c->info.parent = comm;
    c->info.split_color = color;
    c->info.split_key = key;
    next_split_set_ = false;
    *newcomm = reinterpret_cast<ncclComm_t>(c.get());
    comms_.push_back(std::move(c));
    Finish(*comms_.back());
  }
  return Finish(*parent);
}

ncclResult_t FakeNcclApi::CommFinalize(ncclComm_t comm) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclCommFinalize", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclCommFinalize");
  if (c == nullptr) return ncclInvalidUsage;
  c->info.finalized = true;
  return Finish(*c);
}

ncclResult_t FakeNcclApi::CommDestroy(ncclComm_t comm) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclCommDestroy", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclCommDestroy");
  if (c == nullptr) return ncclInvalidUsage;
  c->info.destroyed = true;
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::CommAbort(ncclComm_t comm) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclCommAbort", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclCommAbort", /*allow_in_progress=*/true);
  if (c == nullptr) return ncclInvalidUsage;
  c->info.aborted = true;
  c->pending_polls = 0;
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::CommGetAsyncError(ncclComm_t comm,
                                            ncclResult_t* async_error) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclCommGetAsyncError", &code)) {
    return static_cast<ncclResult_t>(code);
  }
  Comm* c = LiveComm(comm, "ncclCommGetAsyncError", /*allow_in_progress=*/true);
  if (c == nullptr) return ncclInvalidUsage;
  if (c->pending_polls != 0) {
    if (c->pending_polls > 0) --c->pending_polls;
    *async_error = ncclInProgress;
  } else {
    *async_error = async_error_;
  }
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::CommCount(ncclComm_t comm, int* count) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclCommCount", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclCommCount");
  if (c == nullptr) return ncclInvalidUsage;
  *count = c->info.nranks;
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::CommUserRank(ncclComm_t comm, int* rank) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclCommUserRank", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclCommUserRank");
  if (c == nullptr) return ncclInvalidUsage;
  *rank = c->info.rank;
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::CommCuDevice(ncclComm_t comm, int* device) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclCommCuDevice", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclCommCuDevice");
  if (c == nullptr) return ncclInvalidUsage;
  *device = c->info.device;
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::RedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                               ncclDataType_t datatype,
                                               ncclScalarResidence_t residence,
                                               ncclComm_t comm) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclRedOpCreatePreMulSum", &code)) {
    return static_cast<ncclResult_t>(code);
  }
  if (LiveComm(comm, "ncclRedOpCreatePreMulSum") == nullptr) {
    return ncclInvalidUsage;
  }
  DType dtype;
  if (!NcclFloatDType(datatype, &dtype)) {
    Misuse("ncclRedOpCreatePreMulSum: not a floating-point datatype");
    return ncclInvalidArgument;
  }
  PreMulSum p;
  p.op = static_cast<ncclRedOp_t>(ncclNumOps + premul_ops_.size());
  // ncclScalarHostImmediate: NCCL reads the scalar before returning.
  p.scalar = LoadAsDouble(scalar, dtype, 0);
  p.datatype = datatype;
  p.residence = residence;
  p.comm = comm;
  premul_ops_.push_back(p);
  *op = p.op;
  return ncclSuccess;
}

ncclResult_t FakeNcclApi::RedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclRedOpDestroy", &code)) return static_cast<ncclResult_t>(code);
  if (LiveComm(comm, "ncclRedOpDestroy") == nullptr) return ncclInvalidUsage;
  for (PreMulSum& p : premul_ops_) {
    if (p.op != op) continue;
    if (p.comm != comm || p.destroyed) {
      Misuse("ncclRedOpDestroy: wrong communicator or destroyed twice");
      return ncclInvalidArgument;
    }
    p.destroyed = true;
    return ncclSuccess;
  }
  Misuse("ncclRedOpDestroy: unknown operator");
  return ncclInvalidArgument;
}

ncclResult_t FakeNcclApi::AllGather(const void* sendbuff, void* recvbuff,
                                    size_t sendcount, ncclDataType_t datatype,
                                    ncclComm_t comm, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclAllGather", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclAllGather");
  if (c == nullptr) return ncclInvalidUsage;
  Collective call;
  call.name = "ncclAllGather";
  call.comm = comm;
  call.sendbuff = sendbuff;
  call.recvbuff = recvbuff;
  call.count = sendcount;
  call.datatype = datatype;
  call.stream = stream;
  call.current_device = CurrentDevice();
  collectives_.push_back(call);
  const size_t block = sendcount * NcclElementSize(datatype);
  const size_t n = static_cast<size_t>(c->info.nranks);
  if (!CheckStream(stream, *c, "ncclAllGather") ||
      !CheckDeviceRange(sendbuff, block, "ncclAllGather sendbuff") ||
      !CheckDeviceRange(recvbuff, n * block, "ncclAllGather recvbuff")) {
    return ncclInvalidArgument;
  }
  const std::vector<char> mine(static_cast<const char*>(sendbuff),
                               static_cast<const char*>(sendbuff) + block);
  char* out = static_cast<char*>(recvbuff);
  std::memset(out, 0, n * block);
  std::memcpy(out + c->info.rank * block, mine.data(), block);
  return Finish(*c);
}

ncclResult_t FakeNcclApi::Reduce(absl::string_view name, const void* sendbuff,
                                 void* recvbuff, size_t count,
                                 size_t send_offset, ncclDataType_t datatype,
                                 ncclRedOp_t op, ncclComm_t comm,
                                 cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin(name, &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, name);
  if (c == nullptr) return ncclInvalidUsage;
  Collective call;
  call.name = std::string(name);
  call.comm = comm;
  call.sendbuff = sendbuff;
  call.recvbuff = recvbuff;
  call.count = count;
  call.datatype = datatype;
  call.op = op;
  call.stream = stream;
  call.current_device = CurrentDevice();
  collectives_.push_back(call);
  const size_t esize = NcclElementSize(datatype);
  const size_t send_count = name == "ncclReduceScatter"
                                ? count * static_cast<size_t>(c->info.nranks)
                                : count;
  if (!CheckStream(stream, *c, name) ||
      !CheckDeviceRange(sendbuff, send_count * esize,
                        absl::StrCat(name, " sendbuff")) ||
      !CheckDeviceRange(recvbuff, count * esize,
                        absl::StrCat(name, " recvbuff"))) {
    return ncclInvalidArgument;
  }
  DType dtype;
  if (!NcclFloatDType(datatype, &dtype)) return ncclInvalidArgument;
  const PreMulSum* premul = nullptr;
  if (op >= ncclNumOps) {
    for (const PreMulSum& p : premul_ops_) {
      if (p.op == op && p.comm == comm && !p.destroyed) premul = &p;
    }
    if (premul == nullptr) {
      Misuse(absl::StrCat(name, ": unknown or destroyed reduction operator"));
      return ncclInvalidArgument;
    }
  }
  const int n = c->info.nranks;
  std::vector<double> result(count);
  for (size_t i = 0; i < count; ++i) {
    const double x = LoadAsDouble(sendbuff, dtype, send_offset + i);
    double y = x;
    if (premul != nullptr) {
      y = x * premul->scalar;
    } else if (op == ncclAvg) {
      y = x / n;
    } else if (op == ncclMax && n > 1) {
      y = std::max(x, 0.0);
    } else if (op == ncclMin && n > 1) {
      y = std::min(x, 0.0);
    } else if (op == ncclProd && n > 1) {
      y = 0;
    }
    result[i] = y;
  }
  for (size_t i = 0; i < count; ++i) {
    StoreFromDouble(recvbuff, dtype, i, result[i]);
  }
  return Finish(*c);
}

ncclResult_t FakeNcclApi::ReduceScatter(const void* sendbuff, void* recvbuff,
                                        size_t recvcount,
                                        ncclDataType_t datatype, ncclRedOp_t op,
                                        ncclComm_t comm, cudaStream_t stream) {
  int rank = 0;
  {
    absl::MutexLock lock(&mu_);
    if (const Comm* c = Find(comms_, comm)) rank = c->info.rank;
  }
  return Reduce("ncclReduceScatter", sendbuff, recvbuff, recvcount,
                recvcount * static_cast<size_t>(rank), datatype, op, comm,
                stream);
}

ncclResult_t FakeNcclApi::AllReduce(const void* sendbuff, void* recvbuff,
                                    size_t count, ncclDataType_t datatype,
                                    ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream) {
  return Reduce("ncclAllReduce", sendbuff, recvbuff, count, 0, datatype, op,
                comm, stream);
}

ncclResult_t FakeNcclApi::Broadcast(const void* sendbuff, void* recvbuff,
                                    size_t count, ncclDataType_t datatype,
                                    int root, ncclComm_t comm,
                                    cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("ncclBroadcast", &code)) return static_cast<ncclResult_t>(code);
  Comm* c = LiveComm(comm, "ncclBroadcast");
  if (c == nullptr) return ncclInvalidUsage;
  Collective call;
  call.name = "ncclBroadcast";
  call.comm = comm;
  call.sendbuff = sendbuff;
  call.recvbuff = recvbuff;
  call.count = count;
  call.datatype = datatype;
  call.root = root;
  call.stream = stream;
  call.current_device = CurrentDevice();
  collectives_.push_back(call);
  const size_t bytes = count * NcclElementSize(datatype);
  if (!CheckStream(stream, *c, "ncclBroadcast") ||
      !CheckDeviceRange(sendbuff, bytes, "ncclBroadcast sendbuff") ||
      !CheckDeviceRange(recvbuff, bytes, "ncclBroadcast recvbuff")) {
    return ncclInvalidArgument;
  }
  if (root < 0 || root >= c->info.nranks) return ncclInvalidArgument;
  if (root == c->info.rank) {
    std::memmove(recvbuff, sendbuff, bytes);
  } else {
    std::memset(recvbuff, 0, bytes);
  }
  return Finish(*c);
}

const char* FakeNcclApi::GetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "fake: no error";
    case ncclUnhandledCudaError:
      return "fake: unhandled cuda error";
    case ncclSystemError:
      return "fake: unhandled system error";
    case ncclInternalError:
      return "fake: internal error";
    case ncclInvalidArgument:
      return "fake: invalid argument";
    case ncclInvalidUsage:
      return "fake: invalid usage";
    case ncclRemoteError:
      return "fake: remote process exited or there was a network error";
    case ncclInProgress:
      return "fake: NCCL operation in progress";
    default:
      return "fake: unknown result code";
  }
}

const char* FakeNcclApi::GetLastError(ncclComm_t comm) {
  absl::MutexLock lock(&mu_);
  return last_error_.c_str();
}

}  // namespace flatparam
