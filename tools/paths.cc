#include "tools/paths.h"

#include <filesystem>
#include <string>
#include <system_error>

namespace flatparam {
namespace tools {

std::string AbsolutePath(absl::string_view path) {
  if (path.empty()) return std::string();
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(
      std::filesystem::path(std::string(path)), error);
  if (error) return std::string(path);
  std::string out = absolute.lexically_normal().string();
  // "dir/" normalises to "/abs/dir/": print it as the directory it names.
  if (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

}  // namespace tools
}  // namespace flatparam
