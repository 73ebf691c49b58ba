#include "tools/helper_binary.h"

#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace flatparam {
namespace tools {

std::string FindHelperBinary(absl::string_view name, const char* env_var) {
  if (const char* env = std::getenv(env_var); env != nullptr && *env != '\0') {
    return env;
  }
  std::vector<std::string> candidates;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string exe = n > 0 ? std::string(self, n) : "";
  for (const char* var : {"RUNFILES_DIR", "TEST_SRCDIR"}) {
    if (const char* dir = std::getenv(var); dir != nullptr && *dir != '\0') {
      candidates.push_back(absl::StrCat(dir, "/flatparam/tools/", name));
    }
  }
  if (!exe.empty()) {
    candidates.push_back(absl::StrCat(exe, ".runfiles/flatparam/tools/", name));
    candidates.push_back(absl::StrCat(exe.substr(0, exe.rfind('/') + 1), name));
  }
  for (const std::string& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) return c;
  }
  return "";
}

}  // namespace tools
}  // namespace flatparam
