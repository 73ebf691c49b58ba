#include "refmodel/tensor_diff.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace flatparam {
namespace refmodel {

double MaxAbsDiff(const std::map<std::string, HostTensor>& a,
                  const std::map<std::string, HostTensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.numel() != t.numel()) return std::nan("");
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double x = t.GetDouble(i);
      const double y = it->second.GetDouble(i);
      if (std::isnan(x) != std::isnan(y)) return std::nan("");
      if (!std::isnan(x)) worst = std::max(worst, std::abs(x - y));
    }
  }
  return a.size() == b.size() ? worst : std::nan("");
}

double MaxAbsDiff(const std::map<std::string, OptimizerState>& a,
                  const std::map<std::string, OptimizerState>& b) {
  double worst = 0;
  for (const auto& [name, state] : a) {
    auto it = b.find(name);
    if (it == b.end()) return std::nan("");
    const double d = MaxAbsDiff(state.tensors, it->second.tensors);
    if (std::isnan(d)) return d;
    worst = std::max(worst, d);
  }
  return a.size() == b.size() ? worst : std::nan("");
}

double MaxAbs(const std::map<std::string, HostTensor>& tensors) {
  double m = 0;
  for (const auto& [name, t] : tensors) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      m = std::max(m, std::abs(t.GetDouble(i)));
    }
  }
  return m;
}

}  // namespace refmodel
}  // namespace flatparam
