// What the argument checks of buffer operations share: a buffer as their
// messages describe it, and whether two buffers (or two byte ranges) share
// memory. The device operations (flatparam/device), the collectives'
// validators (comm/communicator.h) and the backends (comm/mpi, comm/nccl,
// sim) use these, so that the same buffer reads the same in each message.
//
// Thread-safety: pure functions; nothing is dereferenced.
#ifndef FLATPARAM_BASE_BUFFER_CHECKS_H_
#define FLATPARAM_BASE_BUFFER_CHECKS_H_

#include <cstdint>
#include <string>

#include "flatparam/base/buffer.h"

namespace flatparam {

// "6 x float32 on cuda:0": the element count, dtype and device.
std::string DescribeBuffer(ConstBufferRef b);

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte; an empty
// range shares none.
bool BytesOverlap(const void* a, int64_t a_bytes, const void* b,
                  int64_t b_bytes);

// Whether two buffers share a byte: never when either is empty or they are
// on different devices (whose addresses name different memories).
bool BuffersOverlap(ConstBufferRef a, ConstBufferRef b);

}  // namespace flatparam

#endif  // FLATPARAM_BASE_BUFFER_CHECKS_H_
