#include "verify/conformance/golden_data.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "flatparam/base/json_limits.h"

namespace flatparam {
namespace verify {
namespace {

using json = nlohmann::json;

std::string RunfilesPath(const std::string& workspace_path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return workspace_path;
  return absl::StrCat(srcdir, "/", workspace, "/", workspace_path);
}

GoldenData Read(const std::string& workspace_path) {
  GoldenData g;
  const std::string path = RunfilesPath(workspace_path);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    g.error = absl::StrCat("cannot open golden data ", path);
    return g;
  }
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<json> data = ParseJson(text.str(), path);
  if (!data.ok()) {
    g.error =
        absl::StrCat("cannot parse golden data: ", data.status().message());
    return g;
  }
  g.data = *std::move(data);
  return g;
}

}  // namespace

const GoldenData& LoadGoldenData(const std::string& workspace_path) {
  static absl::Mutex mu(absl::kConstInit);
  // Guarded by mu. Never freed: tests hold references until exit, and a
  // std::map never moves its elements.
  static auto* const loaded = new std::map<std::string, GoldenData>;
  absl::MutexLock lock(&mu);
  auto it = loaded->find(workspace_path);
  if (it == loaded->end()) {
    it = loaded->emplace(workspace_path, Read(workspace_path)).first;
  }
  return it->second;
}

std::vector<std::string> GoldenCaseNames(const GoldenData& golden) {
  if (!golden.error.empty()) return {kGoldenLoadFailed};
  std::vector<std::string> names;
  for (const json& c : golden.data.at("cases")) {
    names.push_back(c.at("name").get<std::string>());
  }
  return names;
}

const json& FindByName(const json& list, const std::string& name) {
  for (const json& item : list) {
    if (item.at("name") == name) return item;
  }
  static const json* const kNull = new json();
  return *kNull;
}

std::string GoldenCaseTestName(
    const testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

}  // namespace verify
}  // namespace flatparam
