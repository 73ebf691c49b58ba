// Writes a small safetensors file with one tensor of each flattenable dtype
// (and a 0-d, a zero-size and an integer tensor) to the path in argv[1], for
// testdata/check_safetensors.py to read with plain Python.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/flatten.h"

namespace flatparam {
namespace checkpoint {
namespace {

HostTensor Make(DType dtype, std::vector<int64_t> shape,
                const std::vector<double>& values) {
  HostTensor t(dtype, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) t.SetDouble(i, values[i]);
  return t;
}

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT.safetensors\n", argv[0]);
    return 2;
  }
  const HostTensor f32 =
      Make(DType::kFloat32, {2, 3}, {0, 0.5, 1, 1.5, 2, 2.5});
  const HostTensor f64 = Make(DType::kFloat64, {}, {3.25});
  const HostTensor f16 = Make(DType::kFloat16, {3}, {1, -2, 0.5});
  const HostTensor bf16 = Make(DType::kBFloat16, {2}, {1.5, -4});
  const HostTensor empty(DType::kFloat32, {0, 3});
  const int64_t ints[2] = {-1, int64_t{1} << 40};
  const std::vector<TensorSource> sources = {
      TensorSourceFromHostTensor("layers.0.w", f32),
      TensorSourceFromHostTensor("step", f64),
      TensorSourceFromHostTensor("half", f16),
      TensorSourceFromHostTensor("brain", bf16),
      TensorSourceFromHostTensor("empty", empty),
      TensorSourceFromBytes("ints", DType::kInt64, {2}, ints),
  };
  FileSystem& fs = PosixFileSystem();
  absl::StatusOr<std::unique_ptr<WritableFile>> file =
      fs.NewWritableFile(argv[1]);
  absl::Status status = file.status();
  if (status.ok()) {
    status = WriteSafetensors(**file, argv[1], sources,
                              {{"writer", "flatparam"}}, /*chunk_bytes=*/5);
  }
  if (status.ok()) status = (*file)->Close();
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam

int main(int argc, char** argv) {
  return flatparam::checkpoint::Main(argc, argv);
}
