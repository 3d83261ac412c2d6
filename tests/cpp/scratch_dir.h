// A private directory for one test: created below /tmp, removed with all it
// holds when the ScratchDir is destroyed. Not thread-safe; owned by the test
// (or fixture) that declares it.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cairn::test_util {

class ScratchDir {
 public:
  // Creates /tmp/cairn_NAME_XXXXXX. Throws std::runtime_error if it cannot
  // (gtest reports that as a failure of the test that declared it).
  explicit ScratchDir(std::string_view name)
      : path_("/tmp/cairn_" + std::string(name) + "_XXXXXX") {
    if (::mkdtemp(path_.data()) == nullptr) {
      throw std::runtime_error("mkdtemp " + path_ + ": " + std::strerror(errno));
    }
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace cairn::test_util
