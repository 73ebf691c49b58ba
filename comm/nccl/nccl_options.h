// Options of the NCCL backend (nccl_backend.h, nccl_communicator.h), in a
// header of their own that needs no CUDA headers.
//
// Thread-safety: a plain struct.
#ifndef FLATPARAM_COMM_NCCL_NCCL_OPTIONS_H_
#define FLATPARAM_COMM_NCCL_NCCL_OPTIONS_H_

#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"

namespace flatparam {

struct NcclOptions {
  // How long creating the communicator (sharing the ncclUniqueId over the
  // bootstrap group, then ncclCommInitRankConfig) and finalizing it on
  // destruction may take before the communicator is aborted
  // (DeadlineExceeded). Split() and the collectives use their own options.
  absl::Duration setup_timeout = kDefaultCollectiveTimeout;
  // false: create the NCCL communicator non-blocking (ncclConfig_t::blocking
  // = 0), so that initialization, Split() and the enqueueing of every
  // collective return to the host and can be timed out and aborted. true:
  // NCCL's blocking mode, in which those calls can hang the calling thread
  // when a peer never arrives.
  bool blocking = false;
  // Checks every buffer with cudaPointerGetAttributes before handing it to
  // NCCL: host memory labelled as a CUDA buffer, or memory of another
  // device, is an InvalidArgument error instead of an illegal memory access
  // that would poison the CUDA context. Costs one runtime query per buffer.
  bool check_pointers = true;
  // Each rank's flight recorder (comm/flight_recorder.h), made by the
  // world communicator (Create, Wrap) and shared with its splits: capacity
  // 0 records nothing.
  FlightRecorderOptions flight_recorder = FlightRecorderOptionsFromEnv();
};

}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_NCCL_OPTIONS_H_
