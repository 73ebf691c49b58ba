// A benchmark binary's own flags, parsed out of argv before Google
// Benchmark sees the rest (which rejects what it does not know):
//
//   BenchFlags flags("my_bench");
//   flags.Int64("size_mib", &size_mib, /*min=*/1);
//   flags.Parse(&argc, argv);           // exits 2 on a bad value
//   benchmark::Initialize(&argc, argv);
//
// Apart from mpi_bench_driver so that the benchmarks that need no MPI
// (checkpoint_save_bench, optim_state_bench) can share it.
//
// Thread-safety: runs on the main thread, before anything else.
#ifndef FLATPARAM_BENCHMARKS_BENCH_FLAGS_H_
#define FLATPARAM_BENCHMARKS_BENCH_FLAGS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace flatparam {
namespace bench {

// Flags "--name=value"; "--name-with-dashes=" is accepted for
// "--name_with_dashes=". The pointers are borrowed and written by Parse.
class BenchFlags {
 public:
  explicit BenchFlags(std::string program) : program_(std::move(program)) {}

  // An integer flag; values below `min` are rejected.
  void Int64(std::string name, int64_t* value, int64_t min);
  // A string flag; when `choices` is not empty the value must be one of them.
  void String(std::string name, std::string* value,
              std::vector<std::string> choices = {});
  // "--name", "--name=true|false|1|0", "--noname".
  void Bool(std::string name, bool* value);

  // Removes the registered flags from argv (Google Benchmark gets the rest,
  // in order). A bad value prints "<program>: bad flag <arg> (expected
  // <what>)" and exits with status 2, before MPI is initialised.
  void Parse(int* argc, char** argv) const;

 private:
  struct Flag {
    enum class Kind { kInt64, kString, kBool } kind;
    std::string name;
    void* value;
    int64_t min = 0;
    std::vector<std::string> choices;
  };
  // Whether `arg` is flag `f`; on a match sets the value or sets *error.
  bool Match(const Flag& f, absl::string_view arg, std::string* error) const;

  std::string program_;
  std::vector<Flag> flags_;
};

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_BENCH_FLAGS_H_
