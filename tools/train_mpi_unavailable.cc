// RunTrainMpi() in a build without OpenMPI.
#include "absl/strings/str_format.h"
#include "tools/train.h"

namespace flatparam {
namespace tools {

absl::Status RunTrainMpi(const TrainCommandOptions& options, std::ostream&) {
  return absl::UnimplementedError(absl::StrFormat(
      "--backend=%s: this build has no MPI backend (pkg-config found no "
      "OpenMPI, ompi-c, when the build was configured); install "
      "libopenmpi-dev or use --backend=sim",
      options.backend));
}

}  // namespace tools
}  // namespace flatparam
