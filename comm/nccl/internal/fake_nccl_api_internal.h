// Private to //comm/nccl:fake_nccl_api: what its two implementation files
// share. They are
//   fake_nccl_api.cc       the NCCL calls (communicators, collectives,
//                          pre-multiplied sums, errors) and the test
//                          controls and inspection;
//   fake_nccl_api_cuda.cc  the model of the CUDA runtime calls the backend
//                          makes (devices, streams, events, memory, copies,
//                          last errors), and the refusal of the others.
// Both keep their state in FakeNcclApi, under its one mutex.
#ifndef FLATPARAM_COMM_NCCL_INTERNAL_FAKE_NCCL_API_INTERNAL_H_
#define FLATPARAM_COMM_NCCL_INTERNAL_FAKE_NCCL_API_INTERNAL_H_

#include <memory>
#include <vector>

namespace flatparam {
namespace internal_fake_nccl {

// The calling thread's current CUDA device in the model (per thread, as in
// CUDA; shared by every FakeNcclApi).
int& CurrentDevice();

// The object whose address is `handle`, or null.
template <typename T, typename Handle>
T* Find(const std::vector<std::unique_ptr<T>>& objects, Handle handle) {
  for (const auto& object : objects) {
    if (reinterpret_cast<Handle>(object.get()) == handle) return object.get();
  }
  return nullptr;
}

}  // namespace internal_fake_nccl
}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_INTERNAL_FAKE_NCCL_API_INTERNAL_H_
