// Lexical helpers for local paths, shared by the checks that compare
// directories (copy.cc's RelateDirs, tiers.cc's tier overlap check).
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace cairn::internal {

// The components of `path`, without empty ones and "."; with resolve_dotdot,
// ".." also drops the component before it (os.path.normpath on an absolute
// path; ".." above "/" stays at "/").
inline std::vector<std::string> PathComponents(std::string_view path, bool resolve_dotdot) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos <= path.size();) {
    const size_t slash = std::min(path.find('/', pos), path.size());
    std::string c(path.substr(pos, slash - pos));
    if (resolve_dotdot && c == "..") {
      if (!out.empty()) out.pop_back();
    } else if (!c.empty() && c != ".") {
      out.push_back(std::move(c));
    }
    pos = slash + 1;
  }
  return out;
}

// "/" followed by the first `n` of `comps` joined by "/"; "/" when n is 0.
inline std::string JoinComponents(const std::vector<std::string>& comps, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += "/" + comps[i];
  return out.empty() ? "/" : out;
}

}  // namespace cairn::internal
