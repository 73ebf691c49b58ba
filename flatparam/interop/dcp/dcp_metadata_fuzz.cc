// Fuzz target for the DCP reader (dcp.h): any .metadata must be read or
// refused with DataLoss, FailedPrecondition or InvalidArgument, never
// crash, hang, allocate without bound, or execute anything.
//
// The first input byte chooses what the rest is:
//   even: a .metadata pickle, parsed and validated (ParseDcpMetadata);
//   odd:  the same, as the .metadata of a directory that also holds the
//         .distcp files of testdata/dcp/v2 (FUZZ_DCP_ITEMS names their
//         folder), opened, and every item read.
// A parsed checkpoint must hold what validation promised: chunks within
// their tensors, and each read tensor of its entry's dtype and shape.
//
// Under Bazel it runs as the ordinary test dcp_metadata_fuzz_test (GCC has
// no libFuzzer) over the seeds in testdata/dcp_seeds and deterministic
// mutations of them (internal/pickle_fuzz_cases.cc); run_dcp_fuzzer.sh builds
// it with clang's libFuzzer. New crashers go into testdata/dcp_seeds.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/interop/dcp/dcp.h"

namespace {

using ::flatparam::checkpoint::FileSystem;
using ::flatparam::checkpoint::JoinPath;
using ::flatparam::checkpoint::PosixFileSystem;
using ::flatparam::libtorch::DcpEntry;
using ::flatparam::libtorch::DcpMetadata;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "dcp_metadata_fuzz: %s\n", what.c_str());
  std::abort();
}

void Check(bool condition, const std::string& what) {
  if (!condition) Fail(what);
}

void CheckRefusal(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  const absl::StatusCode code = s.code();
  Check(code == absl::StatusCode::kDataLoss ||
            code == absl::StatusCode::kFailedPrecondition ||
            code == absl::StatusCode::kInvalidArgument,
        absl::StrCat(what, " refused with an unexpected code: ", s.ToString()));
}

void CheckMetadata(const DcpMetadata& md) {
  for (const auto& [key, e] : md.entries) {
    if (e.kind != DcpEntry::Kind::kTensor) continue;
    for (const auto& c : e.chunks) {
      Check(c.offsets.size() == e.shape.size() &&
                c.sizes.size() == e.shape.size(),
            key + ": a chunk of another rank");
      for (size_t d = 0; d < e.shape.size(); ++d) {
        Check(c.offsets[d] + c.sizes[d] <= e.shape[d],
              key + ": a chunk beyond its tensor");
      }
    }
  }
}

// A directory holding v2's .distcp files, made once per process.
const std::string& ScratchDir() {
  static const std::string* dir = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    auto* d = new std::string(absl::StrCat(tmp != nullptr ? tmp : "/tmp",
                                           "/dcp_metadata_fuzz.", getpid()));
    FileSystem& fs = PosixFileSystem();
    fs.CreateDir(*d).IgnoreError();
    const char* items = std::getenv("FUZZ_DCP_ITEMS");
    const std::string from =
        items != nullptr ? items : "flatparam/interop/dcp/testdata/dcp/v2";
    for (const char* name : {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}) {
      absl::StatusOr<std::string> bytes =
          flatparam::checkpoint::ReadFileToString(fs, JoinPath(from, name),
                                                  1 << 20);
      Check(bytes.ok(), absl::StrCat("reading ", from, "/", name, ": ",
                                     bytes.status().ToString()));
      std::ofstream out(JoinPath(*d, name), std::ios::binary | std::ios::trunc);
      out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
      Check(out.good(), "cannot write " + *d);
    }
    return d;
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) {
    absl::StatusOr<DcpMetadata> md =
        flatparam::libtorch::ParseDcpMetadata(rest, ".metadata");
    CheckRefusal(md.status(), "ParseDcpMetadata");
    if (md.ok()) CheckMetadata(*md);
    return 0;
  }
  FileSystem& fs = PosixFileSystem();
  const std::string& dir = ScratchDir();
  {
    std::ofstream out(JoinPath(dir, ".metadata"),
                      std::ios::binary | std::ios::trunc);
    out.write(rest.data(), static_cast<std::streamsize>(rest.size()));
    Check(out.good(), "cannot write the scratch .metadata");
  }
  absl::StatusOr<flatparam::libtorch::DcpReader> dcp =
      flatparam::libtorch::DcpReader::Open(fs, dir);
  CheckRefusal(dcp.status(), "DcpReader::Open");
  if (!dcp.ok()) return 0;
  CheckMetadata(dcp->metadata());
  for (const auto& [key, e] : dcp->metadata().entries) {
    if (e.kind == DcpEntry::Kind::kBytes) {
      CheckRefusal(dcp->ReadBytes(key).status(), "ReadBytes");
      continue;
    }
    absl::StatusOr<flatparam::HostTensor> t = dcp->ReadTensor(key);
    CheckRefusal(t.status(), "ReadTensor");
    if (t.ok()) {
      Check(t->dtype() == e.dtype && t->shape() == e.shape,
            key + ": read unlike its entry");
    }
  }
  return 0;
}
