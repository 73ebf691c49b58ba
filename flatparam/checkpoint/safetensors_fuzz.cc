// Fuzz target for SafetensorsReader: any byte string must either be
// rejected with DataLoss or open as a file whose every tensor can be read,
// and never crash, hang or read out of bounds.
//
// Under Bazel it runs as the ordinary test safetensors_fuzz_test (GCC has
// no libFuzzer), over the seeds in testdata/safetensors and deterministic
// mutations of them; with --config=asan that run is sanitized too.
//
// With clang, run_safetensors_fuzzer.sh (next to this file) builds it as a
// real coverage-guided libFuzzer binary with ASan and UBSan, against the
// system Abseil, and runs it from the seeds:
//
//   flatparam/checkpoint/run_safetensors_fuzzer.sh [seconds] [libFuzzer flags]
//
// New crashers go into testdata/safetensors as regression seeds.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"

namespace {

using ::flatparam::checkpoint::NewStringRandomAccessFile;
using ::flatparam::checkpoint::SafetensorsEntry;
using ::flatparam::checkpoint::SafetensorsReader;
using ::flatparam::checkpoint::SafetensorsReadOptions;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "safetensors_fuzz: %s\n", what.c_str());
  std::abort();
}

void Check(bool condition, const std::string& what) {
  if (!condition) Fail(what);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  SafetensorsReadOptions options;
  // Inputs are small; a small cap keeps each run fast.
  options.max_header_bytes = uint64_t{1} << 20;
  absl::StatusOr<SafetensorsReader> reader = SafetensorsReader::Open(
      NewStringRandomAccessFile(bytes, "fuzz.safetensors"), options);
  if (!reader.ok()) {
    Check(reader.status().code() == absl::StatusCode::kDataLoss,
          "rejected with a code other than DataLoss: " +
              reader.status().ToString());
    return 0;
  }
  // Accepted: the tensors tile the data section exactly and every one reads.
  uint64_t expected = 0;
  for (const SafetensorsEntry& e : reader->tensors()) {
    Check(e.begin == expected, "tensors do not tile the data section");
    Check(e.end >= e.begin, "tensor ends before it begins");
    expected = e.end;
    absl::StatusOr<flatparam::HostTensor> t = reader->ReadHostTensor(e.name);
    Check(t.ok(), "accepted tensor does not read: " + t.status().ToString());
    Check(t->nbytes() == e.nbytes(), "tensor size differs from its offsets");
    if (e.nbytes() > 0) {
      char last;
      Check(reader->ReadRange(e.name, e.nbytes() - 1, absl::MakeSpan(&last, 1))
                .ok(),
            "last byte of an accepted tensor does not read");
      Check(
          !reader->ReadRange(e.name, e.nbytes(), absl::MakeSpan(&last, 1)).ok(),
          "byte past the end of a tensor reads");
    }
  }
  Check(reader->data_offset() + expected == size,
        "tensors do not end at the end of the file");
  Check(reader->data_offset() <= size, "data section starts past the end");
  return 0;
}
