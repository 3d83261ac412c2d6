// SplitUri: the one split of "SCHEME://AUTHORITY/PATH" for the backends whose
// URIs name something (a bucket) before a path.
#pragma once

#include <string>
#include <string_view>

#include "cairn/status.h"

namespace cairn::internal {

struct UriParts {
  std::string_view authority;  // up to the first '/' after the scheme
  std::string_view path;       // the rest, without trailing '/'; "" when none
};

// Splits `uri`, which must start with `scheme` (e.g. "s3://"); the parts
// point into `uri`. kInvalidArgument otherwise ("not a s3:// URI: ...").
inline Result<UriParts> SplitUri(std::string_view uri, std::string_view scheme) {
  if (uri.substr(0, scheme.size()) != scheme) {
    return InvalidArgumentError("not a " + std::string(scheme) + " URI: " + std::string(uri));
  }
  std::string_view rest = uri.substr(scheme.size());
  const size_t slash = rest.find('/');
  UriParts parts{rest.substr(0, slash), {}};
  if (slash != std::string_view::npos) parts.path = rest.substr(slash + 1);
  while (!parts.path.empty() && parts.path.back() == '/') parts.path.remove_suffix(1);
  return parts;
}

}  // namespace cairn::internal
