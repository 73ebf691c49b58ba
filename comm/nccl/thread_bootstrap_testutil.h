// A bootstrap group for NCCL tests (test-only): `size` in-process ranks, one
// per thread, whose AllGatherBytes and Barrier meet in shared memory. The
// buffer collectives and Split are Unimplemented; a bootstrap only needs to
// share the ncclUniqueId.
//
//   std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(4);
//   // thread r: NcclCommunicator::Create(api, *group[r], r);
//
// Memory: the returned communicators share their state; each must be used
// by one thread. A rank that does not arrive makes the others time out.
//
// Thread-safety: each communicator is used by its own thread.
#ifndef FLATPARAM_COMM_NCCL_THREAD_BOOTSTRAP_TESTUTIL_H_
#define FLATPARAM_COMM_NCCL_THREAD_BOOTSTRAP_TESTUTIL_H_

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace flatparam {

std::vector<std::unique_ptr<Communicator>> MakeThreadGroup(int size);

}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_THREAD_BOOTSTRAP_TESTUTIL_H_
