#include "flatparam/device/cuda/fake_nccl_on_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

// One collective call of one rank.
struct FakeNcclOnCuda::Part {
  std::string name;
  ncclDataType_t datatype = ncclFloat32;
  size_t count = 0;  // NCCL's count argument
  int op = ncclSum;  // ncclRedOp_t, pre-multiplied sums as kPreMul
  double scalar = 1;
  int root = -1;
  const void* send = nullptr;
  void* recv = nullptr;
  int nranks = 0;
  int rank = 0;
};

// One collective of a group, by sequence number.
struct FakeNcclOnCuda::Slot {
  std::vector<std::optional<Part>> parts;
  int arrived = 0;
  int left = 0;
  bool done = false;
};

struct FakeNcclOnCuda::SplitSlot {
  struct Call {
    int color, key, device;
  };
  std::vector<std::optional<Call>> calls;
  int arrived = 0;
  bool done = false;
  std::vector<Comm*> result;  // per parent rank; null for no color
};

struct FakeNcclOnCuda::Group {
  int nranks = 0;
  // A rank's initialization failed in a way every rank sees (NCCL's
  // bootstrap exchange finds duplicate GPUs on all ranks).
  ncclResult_t init_error = ncclSuccess;
  std::vector<Comm*> members;
  int joined = 0;
  int finalized = 0;
  int aborted = 0;  // a finalize cannot complete once a rank has aborted
  std::map<uint64_t, Slot> slots;
  std::map<uint64_t, SplitSlot> splits;
};

struct FakeNcclOnCuda::Comm {
  Group* group = nullptr;
  int rank = 0;
  int device = 0;
  bool blocking = true;
  bool aborted = false;
  bool destroyed = false;
  bool finalized = false;
  uint64_t next_seq = 0;
  uint64_t next_split = 0;
  std::map<int, double> premul;  // ncclRedOp_t -> scalar
  int next_op = ncclNumOps;
};

namespace {

constexpr int kPreMul = -1;

// The dtype of a floating-point NCCL type (float32 for the others, which
// only move bytes).
DType ToDType(ncclDataType_t d) {
  DType dtype = DType::kFloat32;
  NcclFloatDType(d, &dtype);
  return dtype;
}

bool IsFloat(ncclDataType_t d) {
  DType unused;
  return NcclFloatDType(d, &unused);
}

// `v` rounded to `dtype` (through float32 for the 16-bit types).
double Round(DType dtype, double v) {
  if (dtype == DType::kFloat64) return v;
  const float f = static_cast<float>(v);
  if (dtype == DType::kFloat32) return f;
  uint16_t bits = 0;
  StoreFromDouble(&bits, dtype, 0, f);
  return LoadAsDouble(&bits, dtype, 0);
}

// Why the send and receive ranges of one rank's collective overlap other
// than as NCCL documents in place (sendbuff == recvbuff for all-reduce and
// broadcast; sendbuff == recvbuff + rank * sendcount for all-gather;
// recvbuff == sendbuff + rank * recvcount for reduce-scatter), or "" if
// they do not. Other overlaps are undefined: NCCL reads what it has
// already overwritten.
std::string OverlapError(absl::string_view name, const char* send,
                         size_t send_bytes, const char* recv, size_t recv_bytes,
                         size_t count_bytes, int rank) {
  if (send_bytes == 0 || recv_bytes == 0 || send + send_bytes <= recv ||
      recv + recv_bytes <= send) {
    return "";
  }
  const size_t at = static_cast<size_t>(rank) * count_bytes;
  if ((name == "ncclAllReduce" || name == "ncclBroadcast") && send == recv) {
    return "";
  }
  if (name == "ncclAllGather" && send == recv + at) return "";
  if (name == "ncclReduceScatter" && recv == send + at) return "";
  return absl::StrFormat(
      "send [%p, +%d) and receive [%p, +%d) overlap, but not in place as NCCL "
      "documents it",
      send, send_bytes, recv, recv_bytes);
}

}  // namespace

std::string FakeNcclOnCuda::BadOverlap(const Part& part) {
  const size_t es = NcclElementSize(part.datatype);
  size_t send_bytes = part.count * es, recv_bytes = part.count * es;
  if (part.name == "ncclAllGather") recv_bytes *= part.nranks;
  if (part.name == "ncclReduceScatter") send_bytes *= part.nranks;
  // A broadcast reads its send buffer on the root only.
  if (part.name == "ncclBroadcast" && part.root != part.rank) send_bytes = 0;
  return OverlapError(part.name, static_cast<const char*>(part.send),
                      send_bytes, static_cast<const char*>(part.recv),
                      recv_bytes, part.count * es, part.rank);
}

FakeNcclOnCuda::FakeNcclOnCuda(FakeCudaRuntime& cuda) : cuda_(cuda) {}

FakeNcclOnCuda::~FakeNcclOnCuda() = default;

void FakeNcclOnCuda::SetAsyncError(ncclResult_t error) {
  cuda_.Locked([&] { async_error_ = error; });
}

std::vector<std::string> FakeNcclOnCuda::misuse() const {
  std::vector<std::string> out;
  cuda_.Locked([&] { out = misuse_; });
  return out;
}

int64_t FakeNcclOnCuda::collectives_completed() const {
  int64_t n = 0;
  cuda_.Locked([&] { n = completed_; });
  return n;
}

int FakeNcclOnCuda::comms_destroyed() const {
  int n = 0;
  cuda_.Locked([&] {
    for (const auto& c : comms_) n += c->destroyed ? 1 : 0;
  });
  return n;
}

int FakeNcclOnCuda::comms_aborted() const {
  int n = 0;
  cuda_.Locked([&] {
    for (const auto& c : comms_) n += c->aborted ? 1 : 0;
  });
  return n;
}

FakeNcclOnCuda::Comm* FakeNcclOnCuda::Live(ncclComm_t comm, const char* call) {
  for (const auto& c : comms_) {
    if (reinterpret_cast<ncclComm_t>(c.get()) != comm) continue;
    if (c->aborted || c->destroyed) {
      misuse_.push_back(
          absl::StrFormat("%s on a communicator after %s", call,
                          c->aborted ? "ncclCommAbort" : "ncclCommDestroy"));
      return nullptr;
    }
    return c.get();
  }
  misuse_.push_back(absl::StrFormat("%s on an unknown communicator", call));
  return nullptr;
}

// ---- NCCL ----

ncclResult_t FakeNcclOnCuda::GetVersion(int* version) {
  *version = 22809;
  return ncclSuccess;
}

ncclResult_t FakeNcclOnCuda::GetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof(*id));
  int64_t n = 0;
  cuda_.Locked([&] { n = next_id_++; });
  const std::string name = absl::StrFormat("fake-nccl-%d", n);
  std::memcpy(id->internal, name.data(), name.size());
  return ncclSuccess;
}

ncclResult_t FakeNcclOnCuda::CommInitRankConfig(ncclComm_t* comm, int nranks,
                                                ncclUniqueId id, int rank,
                                                ncclConfig_t* config) {
  int device = 0;
  if (cuda_.GetDevice(&device) != cudaSuccess) return ncclUnhandledCudaError;
  const std::string key(id.internal, sizeof(id.internal));
  const bool blocking = config == nullptr || config->blocking != 0;
  ncclResult_t result = ncclSuccess;
  Comm* made = nullptr;
  cuda_.Locked([&] {
    std::unique_ptr<Group>& g = groups_[key];
    if (g == nullptr) {
      g = std::make_unique<Group>();
      g->nranks = nranks;
      g->members.assign(nranks, nullptr);
    }
    if (g->nranks != nranks || rank < 0 || rank >= nranks ||
        g->members[rank] != nullptr) {
      misuse_.push_back(absl::StrFormat(
          "ncclCommInitRank: rank %d of %d does not fit the group of %d", rank,
          nranks, g->nranks));
      result = ncclInvalidArgument;
      return;
    }
    for (const Comm* m : g->members) {
      if (m != nullptr && m->device == device) {
        // NCCL: "Duplicate GPU detected", on every rank.
        result = ncclInvalidUsage;
        g->init_error = result;
        return;
      }
    }
    auto c = std::make_unique<Comm>();
    c->group = g.get();
    c->rank = rank;
    c->device = device;
    c->blocking = blocking;
    made = c.get();
    comms_.push_back(std::move(c));
    g->members[rank] = made;
    ++g->joined;
  });
  if (made == nullptr) return result;
  *comm = reinterpret_cast<ncclComm_t>(made);
  if (!blocking) return ncclInProgress;
  Group* g = made->group;
  cuda_.WaitUntil(
      [g] { return g->joined == g->nranks || g->init_error != ncclSuccess; });
  ncclResult_t error = ncclSuccess;
  cuda_.Locked([&] { error = g->init_error; });
  return error;
}

ncclResult_t FakeNcclOnCuda::CommSplit(ncclComm_t comm, int color, int key,
                                       ncclComm_t* newcomm,
                                       ncclConfig_t* config) {
  Comm* c = nullptr;
  SplitSlot* slot = nullptr;
  cuda_.Locked([&] {
    c = Live(comm, "ncclCommSplit");
    if (c == nullptr) return;
    Group& g = *c->group;
    slot = &g.splits[c->next_split++];
    if (slot->calls.empty()) slot->calls.resize(g.nranks);
    slot->calls[c->rank] = SplitSlot::Call{color, key, c->device};
    if (++slot->arrived < g.nranks) return;
    // The last rank to arrive makes the children.
    slot->result.assign(g.nranks, nullptr);
    std::map<int, std::vector<std::pair<std::pair<int, int>, int>>> by_color;
    for (int r = 0; r < g.nranks; ++r) {
      const SplitSlot::Call& call = *slot->calls[r];
      if (call.color >= 0) by_color[call.color].push_back({{call.key, r}, r});
    }
    for (auto& [col, members] : by_color) {
      std::sort(members.begin(), members.end());
      auto child = std::make_unique<Group>();
      child->nranks = static_cast<int>(members.size());
      child->members.assign(members.size(), nullptr);
      child->joined = child->nranks;
      for (size_t i = 0; i < members.size(); ++i) {
        const int parent_rank = members[i].second;
        auto made = std::make_unique<Comm>();
        made->group = child.get();
        made->rank = static_cast<int>(i);
        made->device = slot->calls[parent_rank]->device;
        made->blocking = g.members[parent_rank]->blocking;
        child->members[i] = made.get();
        slot->result[parent_rank] = made.get();
        comms_.push_back(std::move(made));
      }
      split_groups_.push_back(std::move(child));
    }
    slot->done = true;
  });
  if (c == nullptr) return ncclInvalidUsage;
  cuda_.WaitUntil([slot] { return slot->done; });
  Comm* mine = nullptr;
  cuda_.Locked([&] { mine = slot->result[c->rank]; });
  *newcomm = reinterpret_cast<ncclComm_t>(mine);
  return ncclSuccess;
}

ncclResult_t FakeNcclOnCuda::CommFinalize(ncclComm_t comm) {
  Comm* c = nullptr;
  cuda_.Locked([&] {
    c = Live(comm, "ncclCommFinalize");
    if (c != nullptr && !c->finalized) {
      c->finalized = true;
      ++c->group->finalized;
    }
  });
  if (c == nullptr) return ncclInvalidUsage;
  if (!c->blocking) return ncclInProgress;
  Group* g = c->group;
  // Blocking: waits for global quiescence, possibly forever.
  cuda_.WaitUntil([g] { return g->finalized == g->nranks && g->aborted == 0; });
  return ncclSuccess;
}

ncclResult_t FakeNcclOnCuda::CommDestroy(ncclComm_t comm) {
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    Comm* c = Live(comm, "ncclCommDestroy");
    if (c == nullptr) {
      result = ncclInvalidUsage;
      return;
    }
    const Group& g = *c->group;
    if (c->finalized && (g.finalized < g.nranks || g.aborted > 0)) {
      // NCCL: after ncclCommFinalize, wait for ncclSuccess before destroying.
      misuse_.push_back(absl::StrFormat(
          "ncclCommDestroy: rank %d destroyed its communicator while its "
          "ncclCommFinalize was still in progress",
          c->rank));
      result = ncclInvalidUsage;
      return;
    }
    c->destroyed = true;
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::CommAbort(ncclComm_t comm) {
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    for (const auto& c : comms_) {
      if (reinterpret_cast<ncclComm_t>(c.get()) == comm && !c->destroyed &&
          !c->aborted) {
        // Its collectives waiting for peers give up (NCCL's kernels exit).
        c->aborted = true;
        ++c->group->aborted;
        return;
      }
    }
    misuse_.push_back("ncclCommAbort on an unknown or released communicator");
    result = ncclInvalidUsage;
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::CommGetAsyncError(ncclComm_t comm,
                                               ncclResult_t* async_error) {
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    Comm* c = Live(comm, "ncclCommGetAsyncError");
    if (c == nullptr) {
      result = ncclInvalidUsage;
      return;
    }
    const Group& g = *c->group;
    if (async_error_ != ncclSuccess) {
      *async_error = async_error_;
    } else if (g.init_error != ncclSuccess) {
      *async_error = g.init_error;
    } else if (g.joined < g.nranks ||
               (c->finalized && (g.finalized < g.nranks || g.aborted > 0))) {
      *async_error = ncclInProgress;
    } else {
      *async_error = ncclSuccess;
    }
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::CommCount(ncclComm_t comm, int* count) {
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    Comm* c = Live(comm, "ncclCommCount");
    if (c == nullptr) {
      result = ncclInvalidUsage;
    } else {
      *count = c->group->nranks;
    }
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::CommUserRank(ncclComm_t comm, int* rank) {
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    Comm* c = Live(comm, "ncclCommUserRank");
    if (c == nullptr) {
      result = ncclInvalidUsage;
    } else {
      *rank = c->rank;
    }
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::CommCuDevice(ncclComm_t comm, int* device) {
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    Comm* c = Live(comm, "ncclCommCuDevice");
    if (c == nullptr) {
      result = ncclInvalidUsage;
    } else {
      *device = c->device;
    }
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::RedOpCreatePreMulSum(
    ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
    ncclScalarResidence_t residence, ncclComm_t comm) {
  if (!IsFloat(datatype) || residence != ncclScalarHostImmediate) {
    return ncclInvalidArgument;
  }
  // ncclScalarHostImmediate: read before returning.
  const double value = LoadAsDouble(scalar, ToDType(datatype), 0);
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    Comm* c = Live(comm, "ncclRedOpCreatePreMulSum");
    if (c == nullptr) {
      result = ncclInvalidUsage;
      return;
    }
    const int id = c->next_op++;
    c->premul[id] = value;
    *op = static_cast<ncclRedOp_t>(id);
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::RedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  ncclResult_t result = ncclSuccess;
  cuda_.Locked([&] {
    Comm* c = Live(comm, "ncclRedOpDestroy");
    if (c == nullptr || c->premul.erase(static_cast<int>(op)) == 0) {
      result = ncclInvalidArgument;
    }
  });
  return result;
}

ncclResult_t FakeNcclOnCuda::Enqueue(const char* name, Part part,
                                     ncclComm_t comm, cudaStream_t stream) {
  Comm* c = nullptr;
  uint64_t seq = 0;
  ncclResult_t result = ncclSuccess;
  const int stream_device = cuda_.StreamDevice(stream);
  cuda_.Locked([&] {
    c = Live(comm, name);
    if (c == nullptr) {
      result = ncclInvalidUsage;
      return;
    }
    if (stream_device != c->device) {
      misuse_.push_back(absl::StrFormat(
          "%s: rank %d's stream is on cuda:%d, its communicator on cuda:%d",
          name, c->rank, stream_device, c->device));
      result = ncclInvalidUsage;
      return;
    }
    if (part.op >= ncclNumOps) {
      auto it = c->premul.find(part.op);
      if (it == c->premul.end()) {
        result = ncclInvalidArgument;
        return;
      }
      part.scalar = it->second;
      part.op = kPreMul;
    }
    if (c->finalized) {
      misuse_.push_back(absl::StrFormat(
          "%s: rank %d issued a collective after ncclCommFinalize", name,
          c->rank));
      result = ncclInvalidUsage;
      return;
    }
    part.nranks = c->group->nranks;
    part.rank = c->rank;
    if (std::string why = BadOverlap(part); !why.empty()) {
      misuse_.push_back(absl::StrFormat("%s: rank %d: %s", name, c->rank, why));
      result = ncclInvalidArgument;
      return;
    }
    seq = c->next_seq++;
  });
  if (result != ncclSuccess) return result;
  const size_t es = NcclElementSize(part.datatype);
  size_t send_bytes = part.count * es, recv_bytes = part.count * es;
  if (part.name == "ncclAllGather") recv_bytes *= part.nranks;
  if (part.name == "ncclReduceScatter") send_bytes *= part.nranks;
  std::vector<FakeCudaRuntime::Range> touches;
  if (send_bytes > 0 &&
      (part.name != "ncclBroadcast" || part.root == part.rank)) {
    touches.push_back({part.send, send_bytes});
  }
  if (recv_bytes > 0) touches.push_back({part.recv, recv_bytes});
  const cudaError_t e =
      cuda_.EnqueueWork(stream, name, std::move(touches),
                        [this, c, seq, part] { Arrive(c, seq, part); });
  if (e != cudaSuccess) {
    cuda_.GetLastError();
    return ncclUnhandledCudaError;
  }
  return ncclSuccess;
}

void FakeNcclOnCuda::Arrive(Comm* c, uint64_t seq, const Part& part) {
  Slot* slot = nullptr;
  bool last = false;
  std::vector<Part> parts;
  cuda_.Locked([&] {
    Group& g = *c->group;
    slot = &g.slots[seq];
    if (slot->parts.empty()) slot->parts.resize(g.nranks);
    slot->parts[c->rank] = part;
    last = ++slot->arrived == g.nranks;
    if (!last) return;
    for (const auto& p : slot->parts) parts.push_back(*p);
    for (const Part& p : parts) {
      const Part& first = parts[0];
      if (p.name != first.name || p.datatype != first.datatype ||
          p.count != first.count || p.op != first.op || p.root != first.root) {
        // The ranks disagree: on GPUs this hangs (or corrupts memory).
        misuse_.push_back(absl::StrFormat(
            "collective #%d: rank %d called %s (count %d, dtype %d), rank %d "
            "%s (count %d, dtype %d)",
            seq, first.rank, first.name, first.count, first.datatype, p.rank,
            p.name, p.count, p.datatype));
        parts.clear();
        return;
      }
    }
  });
  if (last && !parts.empty()) {
    // Every rank's stream is parked here: their buffers are quiet.
    Execute(parts);
    cuda_.Locked([&] {
      slot->done = true;
      ++completed_;
    });
  }
  cuda_.WaitUntil([slot, c] { return slot->done || c->aborted; });
  cuda_.Locked([&] {
    if (++slot->left == c->group->nranks) c->group->slots.erase(seq);
  });
}

void FakeNcclOnCuda::Execute(const std::vector<Part>& device_parts) {
  // Device memory is read and written through its host views.
  std::vector<Part> parts = device_parts;
  for (Part& p : parts) {
    p.send = cuda_.HostAlias(p.send);
    p.recv = cuda_.HostAlias(p.recv);
  }
  const Part& p0 = parts[0];
  const size_t n = parts.size();
  const size_t es = NcclElementSize(p0.datatype);
  const size_t count = p0.count;
  const DType dtype = ToDType(p0.datatype);
  // NCCL averages floating-point types as a pre-multiplied sum by 1/n
  // converted to the dtype (through float32 for all but float64), not as a
  // sum divided at the end: the bits differ from n = 3 on.
  const bool premul_avg = p0.op == ncclAvg && IsFloat(p0.datatype);
  const double inv_n =
      dtype == DType::kFloat64
          ? 1.0 / static_cast<double>(n)
          : Round(dtype, static_cast<float>(1.0 / static_cast<double>(n)));
  // Results are computed before any is written: buffers may be in place.
  auto reduce = [&](size_t offset, std::vector<char>& out) {
    out.assign(count * es, 0);
    for (size_t i = 0; i < count; ++i) {
      double acc = 0;
      for (size_t r = 0; r < n; ++r) {
        double x = LoadAsDouble(parts[r].send, dtype, offset + i);
        // Each rank multiplies by its own scalar (ncclRedOpCreatePreMulSum
        // is per rank; FSDP's ranks pass the same one, but nothing makes
        // them).
        if (p0.op == kPreMul) {
          x = Round(dtype, Round(dtype, x) * parts[r].scalar);
        } else if (premul_avg) {
          x = Round(dtype, Round(dtype, x) * inv_n);
        }
        if (r == 0) {
          acc = x;
        } else if (p0.op == ncclMax) {
          acc = std::isnan(acc) || std::isnan(x) ? NAN : std::max(acc, x);
        } else if (p0.op == ncclMin) {
          acc = std::isnan(acc) || std::isnan(x) ? NAN : std::min(acc, x);
        } else {
          acc = Round(dtype, acc + x);
        }
      }
      if (p0.op == ncclAvg && !premul_avg) {
        acc = std::trunc(acc / static_cast<double>(n));  // integers
      }
      StoreFromDouble(out.data(), dtype, i, acc);
    }
  };
  if (p0.name == "ncclAllGather") {
    std::vector<char> all(n * count * es);
    for (size_t r = 0; r < n; ++r) {
      std::memcpy(all.data() + r * count * es, parts[r].send, count * es);
    }
    for (const Part& p : parts) std::memcpy(p.recv, all.data(), all.size());
  } else if (p0.name == "ncclBroadcast") {
    std::vector<char> data(
        static_cast<const char*>(parts[p0.root].send),
        static_cast<const char*>(parts[p0.root].send) + count * es);
    for (const Part& p : parts) std::memcpy(p.recv, data.data(), data.size());
  } else if (p0.name == "ncclAllReduce") {
    std::vector<char> out;
    reduce(0, out);
    for (const Part& p : parts) std::memcpy(p.recv, out.data(), out.size());
  } else if (p0.name == "ncclReduceScatter") {
    std::vector<std::vector<char>> out(n);
    for (size_t r = 0; r < n; ++r) reduce(r * count, out[r]);
    for (size_t r = 0; r < n; ++r) {
      std::memcpy(parts[r].recv, out[r].data(), out[r].size());
    }
  }
}

ncclResult_t FakeNcclOnCuda::AllGather(const void* sendbuff, void* recvbuff,
                                       size_t sendcount,
                                       ncclDataType_t datatype, ncclComm_t comm,
                                       cudaStream_t stream) {
  Part p;
  p.name = "ncclAllGather";
  p.datatype = datatype;
  p.count = sendcount;
  p.send = sendbuff;
  p.recv = recvbuff;
  return Enqueue("ncclAllGather", std::move(p), comm, stream);
}

ncclResult_t FakeNcclOnCuda::ReduceScatter(const void* sendbuff, void* recvbuff,
                                           size_t recvcount,
                                           ncclDataType_t datatype,
                                           ncclRedOp_t op, ncclComm_t comm,
                                           cudaStream_t stream) {
  if (!IsFloat(datatype)) return ncclInvalidArgument;
  Part p;
  p.name = "ncclReduceScatter";
  p.datatype = datatype;
  p.count = recvcount;
  p.op = static_cast<int>(op);
  p.send = sendbuff;
  p.recv = recvbuff;
  return Enqueue("ncclReduceScatter", std::move(p), comm, stream);
}

ncclResult_t FakeNcclOnCuda::AllReduce(const void* sendbuff, void* recvbuff,
                                       size_t count, ncclDataType_t datatype,
                                       ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream) {
  if (!IsFloat(datatype)) return ncclInvalidArgument;
  Part p;
  p.name = "ncclAllReduce";
  p.datatype = datatype;
  p.count = count;
  p.op = static_cast<int>(op);
  p.send = sendbuff;
  p.recv = recvbuff;
  return Enqueue("ncclAllReduce", std::move(p), comm, stream);
}

ncclResult_t FakeNcclOnCuda::Broadcast(const void* sendbuff, void* recvbuff,
                                       size_t count, ncclDataType_t datatype,
                                       int root, ncclComm_t comm,
                                       cudaStream_t stream) {
  Part p;
  p.name = "ncclBroadcast";
  p.datatype = datatype;
  p.count = count;
  p.root = root;
  p.send = sendbuff;
  p.recv = recvbuff;
  return Enqueue("ncclBroadcast", std::move(p), comm, stream);
}

const char* FakeNcclOnCuda::GetErrorString(ncclResult_t result) {
  return ncclGetErrorString(result);
}

const char* FakeNcclOnCuda::GetLastError(ncclComm_t comm) { return ""; }

}  // namespace flatparam
