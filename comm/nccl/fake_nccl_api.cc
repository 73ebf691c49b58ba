#include "comm/nccl/fake_nccl_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace {

// CUDA's current device is per host thread.
thread_local int current_device = 0;
// The CUDA runtime's per-thread last error: every failing call sets it
// (cudaErrorNotReady from a query included).
thread_local cudaError_t last_cuda_error = cudaSuccess;

cudaError_t LastCudaError(cudaError_t e) {
  if (e != cudaSuccess) last_cuda_error = e;
  return e;
}

template <typename T, typename Handle>
T* Find(const std::vector<std::unique_ptr<T>>& objects, Handle handle) {
  for (const auto& object : objects) {
    if (reinterpret_cast<Handle>(object.get()) == handle) return object.get();
  }
  return nullptr;
}

}  // namespace

FakeNcclApi::FakeNcclApi(int device_count) : device_count_(device_count) {
  current_device = 0;
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
  c->info.device = current_device;
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
  call.current_device = current_device;
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
  call.current_device = current_device;
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
  call.current_device = current_device;
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

cudaError_t FakeNcclApi::GetDeviceCount(int* count) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaGetDeviceCount", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  *count = 0;
  if (device_count_error_ != cudaSuccess) return device_count_error_;
  *count = device_count_;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::GetDevice(int* device) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaGetDevice", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  *device = current_device;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::SetDevice(int device) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaSetDevice", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  if (device < 0 || device >= device_count_)
    return LastCudaError(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::StreamCreateWithFlags(cudaStream_t* stream,
                                               unsigned int flags) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaStreamCreateWithFlags", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  auto s = std::make_unique<Stream>();
  s->device = current_device;
  s->flags = flags;
  *stream = reinterpret_cast<cudaStream_t>(s.get());
  streams_.push_back(std::move(s));
  return cudaSuccess;
}

cudaError_t FakeNcclApi::StreamDestroy(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaStreamDestroy", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Stream* s = Find(streams_, stream);
  if (s == nullptr || s->destroyed) {
    Misuse("cudaStreamDestroy: unknown or destroyed stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  s->destroyed = true;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::EventCreateWithFlags(cudaEvent_t* event,
                                              unsigned int flags) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventCreateWithFlags", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  auto e = std::make_unique<Event>();
  e->device = current_device;
  *event = reinterpret_cast<cudaEvent_t>(e.get());
  events_.push_back(std::move(e));
  return cudaSuccess;
}

cudaError_t FakeNcclApi::EventRecord(cudaEvent_t event, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventRecord", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Event* e = Find(events_, event);
  const Stream* s = Find(streams_, stream);
  if (e == nullptr || e->destroyed || s == nullptr || s->destroyed) {
    Misuse("cudaEventRecord: unknown or destroyed event or stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  if (e->device != s->device) {
    Misuse(absl::StrFormat(
        "cudaEventRecord: event of cuda:%d on a stream of cuda:%d", e->device,
        s->device));
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  e->recorded = true;
  e->pending_queries = event_pending_queries_;
  e->recorded_on = stream;
  e->recorded_at = static_cast<int>(calls_.size()) - 1;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::StreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                         unsigned int flags) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaStreamWaitEvent", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  const Event* e = Find(events_, event);
  const Stream* s = Find(streams_, stream);
  if (e == nullptr || e->destroyed || s == nullptr || s->destroyed) {
    Misuse("cudaStreamWaitEvent: unknown or destroyed event or stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  if (flags != 0) {
    Misuse(absl::StrFormat("cudaStreamWaitEvent: flags %u", flags));
    return LastCudaError(cudaErrorInvalidValue);
  }
  // Waiting for an event never recorded is a no-op in CUDA; record it as
  // such (recorded_at -1).
  stream_waits_.push_back(StreamWait{
      stream, e->recorded ? e->recorded_on : nullptr,
      e->recorded ? e->recorded_at : -1, static_cast<int>(calls_.size()) - 1});
  return cudaSuccess;
}

cudaError_t FakeNcclApi::EventQuery(cudaEvent_t event) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventQuery", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Event* e = Find(events_, event);
  if (e == nullptr || e->destroyed) {
    Misuse("cudaEventQuery: unknown or destroyed event");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  if (!e->recorded || e->pending_queries == 0) return cudaSuccess;
  if (e->pending_queries > 0) --e->pending_queries;
  return LastCudaError(cudaErrorNotReady);
}

cudaError_t FakeNcclApi::EventDestroy(cudaEvent_t event) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventDestroy", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Event* e = Find(events_, event);
  if (e == nullptr || e->destroyed) {
    Misuse("cudaEventDestroy: unknown or destroyed event");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  e->destroyed = true;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::PointerGetAttributes(cudaPointerAttributes* attributes,
                                              const void* ptr) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaPointerGetAttributes", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  std::memset(attributes, 0, sizeof(*attributes));
  const char* p = static_cast<const char*>(ptr);
  auto it = allocations_.upper_bound(p);
  if (it != allocations_.begin()) {
    --it;
    if (p >= it->first && p < it->first + it->second.bytes.size()) {
      attributes->type = cudaMemoryTypeDevice;
      attributes->device = it->second.device;
      attributes->devicePointer = const_cast<void*>(ptr);
      return cudaSuccess;
    }
  }
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -2;
  attributes->hostPointer = const_cast<void*>(ptr);
  return cudaSuccess;
}

char* FakeNcclApi::NewAllocation(size_t bytes) {
  Allocation allocation;
  allocation.bytes.assign(std::max<size_t>(bytes, 1), '\0');
  allocation.device = current_device;
  char* data = allocation.bytes.data();
  allocations_.emplace(data, std::move(allocation));
  return data;
}

cudaError_t FakeNcclApi::Malloc(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMalloc", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  *ptr = NewAllocation(bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaFree", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  if (allocations_.erase(static_cast<const char*>(ptr)) == 0) {
    Misuse(absl::StrFormat("cudaFree(%p): not a live allocation", ptr));
    return LastCudaError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MemcpyAsync(void* dst, const void* src, size_t bytes,
                                     cudaMemcpyKind kind, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMemcpyAsync", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  const Stream* s = Find(streams_, stream);
  if (s == nullptr || s->destroyed) {
    Misuse("cudaMemcpyAsync: unknown or destroyed stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  const bool src_device =
      kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool dst_device =
      kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if ((src_device && !CheckDeviceRange(src, bytes, "cudaMemcpyAsync src")) ||
      (dst_device && !CheckDeviceRange(dst, bytes, "cudaMemcpyAsync dst"))) {
    return LastCudaError(cudaErrorInvalidValue);
  }
  if ((kind == cudaMemcpyHostToDevice && !IsPinned(src, bytes)) ||
      (kind == cudaMemcpyDeviceToHost && !IsPinned(dst, bytes))) {
    ++pageable_copies_;
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MallocAsync(void** ptr, size_t bytes,
                                     cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMallocAsync", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  const Stream* s = Find(streams_, stream);
  if (s == nullptr || s->destroyed) {
    Misuse("cudaMallocAsync: unknown or destroyed stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  *ptr = NewAllocation(bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::FreeAsync(void* ptr, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaFreeAsync", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  if (allocations_.erase(static_cast<const char*>(ptr)) == 0) {
    Misuse(absl::StrFormat("cudaFreeAsync(%p): not a live allocation", ptr));
    return LastCudaError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MallocHost(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMallocHost", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  std::vector<char> block(std::max<size_t>(bytes, 1), '\0');
  char* data = block.data();
  pinned_.emplace(data, std::move(block));
  *ptr = data;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::FreeHost(void* ptr) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaFreeHost", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  if (pinned_.erase(static_cast<const char*>(ptr)) == 0) {
    Misuse(absl::StrFormat("cudaFreeHost(%p): not pinned memory", ptr));
    return LastCudaError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MemsetAsync(void* dst, int value, size_t bytes,
                                     cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMemsetAsync", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  if (!CheckDeviceRange(dst, bytes, "cudaMemsetAsync dst")) {
    return LastCudaError(cudaErrorInvalidValue);
  }
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::GetLastError() {
  const cudaError_t e = last_cuda_error;
  last_cuda_error = cudaSuccess;
  return e;
}

cudaError_t FakeNcclApi::PeekAtLastError() { return last_cuda_error; }

const char* FakeNcclApi::GetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    default:
      return "cudaErrorUnknownToTheFake";
  }
}

const char* FakeNcclApi::GetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "fake: no error" : "fake: CUDA failure";
}

// The CUDA runtime calls the NCCL backend does not make: refused, so that a
// backend change that starts making one shows up in misuse().
cudaError_t FakeNcclApi::NotModelled(absl::string_view call) {
  absl::MutexLock lock(&mu_);
  calls_.push_back(std::string(call));
  Misuse(absl::StrCat(call, ": not modelled by FakeNcclApi"));
  return LastCudaError(cudaErrorNotSupported);
}
cudaError_t FakeNcclApi::DeviceGetAttribute(int*, cudaDeviceAttr, int) {
  return NotModelled("cudaDeviceGetAttribute");
}
cudaError_t FakeNcclApi::DeviceGetDefaultMemPool(cudaMemPool_t*, int) {
  return NotModelled("cudaDeviceGetDefaultMemPool");
}
cudaError_t FakeNcclApi::MemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr,
                                             void*) {
  return NotModelled("cudaMemPoolSetAttribute");
}
cudaError_t FakeNcclApi::MemPoolGetAttribute(cudaMemPool_t, cudaMemPoolAttr,
                                             void*) {
  return NotModelled("cudaMemPoolGetAttribute");
}
cudaError_t FakeNcclApi::StreamSynchronize(cudaStream_t) {
  return NotModelled("cudaStreamSynchronize");
}
cudaError_t FakeNcclApi::StreamQuery(cudaStream_t) {
  return NotModelled("cudaStreamQuery");
}
cudaError_t FakeNcclApi::EventSynchronize(cudaEvent_t) {
  return NotModelled("cudaEventSynchronize");
}
cudaError_t FakeNcclApi::LaunchFill(void*, int, uint64_t, int64_t,
                                    cudaStream_t) {
  return NotModelled("LaunchFill");
}
cudaError_t FakeNcclApi::LaunchCast(void*, internal_cuda::KernelDType,
                                    const void*, internal_cuda::KernelDType,
                                    int64_t, cudaStream_t) {
  return NotModelled("LaunchCast");
}
cudaError_t FakeNcclApi::LaunchMultiply(void*, internal_cuda::KernelDType,
                                        double, int64_t, cudaStream_t) {
  return NotModelled("LaunchMultiply");
}
cudaError_t FakeNcclApi::LaunchAdd(void*, const void*,
                                   internal_cuda::KernelDType, int64_t,
                                   cudaStream_t) {
  return NotModelled("LaunchAdd");
}

}  // namespace flatparam
