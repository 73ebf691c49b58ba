#include "flatparam/base/fqn.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace flatparam {

std::string CleanTensorName(absl::string_view name) {
  std::string s = absl::StrReplaceAll(name, {{kFsdpWrappedPrefix, ""}});
  s = absl::StrReplaceAll(s, {{kCheckpointWrappedPrefix, ""}});
  if (s.find(kCompiledModuleComponent) == std::string::npos) return s;
  std::vector<absl::string_view> parts = absl::StrSplit(s, '.');
  parts.erase(std::remove(parts.begin(), parts.end(),
                          absl::string_view(kCompiledModuleComponent)),
              parts.end());
  return absl::StrJoin(parts, ".");
}

}  // namespace flatparam
