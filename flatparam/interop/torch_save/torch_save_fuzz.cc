// Fuzz target for the torch.save reader (torch_save.h): any input must be
// read or refused with DataLoss, FailedPrecondition or InvalidArgument,
// never crash, hang, allocate without bound, or execute anything.
//
// The first input byte chooses what the rest is:
//   even: data.pkl, the pickle, put into an archive beside the storage
//         records "0".."5" of testdata/tiny_state_dict.pt (zeros of its
//         sizes), so that mutations exercise the unpickler rather than the
//         zip's checksums;
//   odd:  a whole archive file, to exercise the zip reading too.
// Both are read as a state dict and as an optimizer state dict.
//
// Under Bazel it runs as the ordinary test torch_save_fuzz_test (GCC has no
// libFuzzer), over the seeds in testdata/pickles and deterministic
// mutations of them; --config=sanitize runs that under ASan and UBSan.
// New crashers go into testdata/pickles as regression seeds.
#include <caffe2/serialize/inline_container.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/interop/torch_save/torch_save.h"

namespace {

using ::flatparam::checkpoint::FileSystem;
using ::flatparam::checkpoint::PosixFileSystem;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "torch_save_fuzz: %s\n", what.c_str());
  std::abort();
}

void Check(bool condition, const std::string& what) {
  if (!condition) Fail(what);
}

void CheckRefusal(const absl::Status& s, const char* reader) {
  if (s.ok()) return;
  const absl::StatusCode code = s.code();
  Check(
      code == absl::StatusCode::kDataLoss ||
          code == absl::StatusCode::kFailedPrecondition ||
          code == absl::StatusCode::kInvalidArgument,
      absl::StrCat(reader, " refused with an unexpected code: ", s.ToString()));
}

// An archive as torch.save writes it, with `pickle` as data.pkl.
std::string ArchiveAround(const std::string& pickle) {
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* buf, size_t n) {
    out.append(static_cast<const char*>(buf), n);
    return n;
  });
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  const size_t sizes[] = {48, 16, 16, 16, 32, 8};
  for (int i = 0; i < 6; ++i) {
    const std::string zeros(sizes[i], '\0');
    writer.writeRecord(absl::StrCat("data/", i), zeros.data(), zeros.size());
  }
  writer.writeEndOfFile();
  return out;
}

std::string ScratchPath() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/torch_save_fuzz.",
                      getpid(), ".pt");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string file;
  try {
    file = (data[0] & 1) == 0 ? ArchiveAround(rest) : rest;
  } catch (const std::exception& e) {
    Fail(absl::StrCat("writing the archive: ", e.what()));
  }
  FileSystem& fs = PosixFileSystem();
  const std::string path = ScratchPath();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(file.data(), static_cast<std::streamsize>(file.size()));
    Check(out.good(), "cannot write the scratch file " + path);
  }

  absl::StatusOr<flatparam::libtorch::TorchStateDict> sd =
      flatparam::libtorch::ReadTorchStateDict(fs, path);
  CheckRefusal(sd.status(), "ReadTorchStateDict");
  if (sd.ok()) {
    for (const auto& [name, t] : *sd) {
      Check(t.nbytes() == static_cast<size_t>(t.numel()) *
                              flatparam::DTypeSize(t.dtype()),
            "tensor " + name + " has a size unlike its shape's");
    }
  }
  CheckRefusal(flatparam::libtorch::ReadTorchOptimStateDict(fs, path).status(),
               "ReadTorchOptimStateDict");
  return 0;
}
