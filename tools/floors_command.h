// `cairn floors PATH`: the machine floors of include/cairn/floors.h (memcpy,
// O_DIRECT write, parallel O_DIRECT read) measured on the directory PATH,
// implemented in floors_command.cc.
#pragma once

#include <cstdint>
#include <string>

namespace cairn::cli {

struct FloorsCommandOptions {
  std::string path;             // a local directory or file://DIR
  uint64_t bytes = 1ull << 30;  // per floor (the direct-I/O file is as large)
  int reps = 3;                 // medians of this many
  bool drop_caches = true;      // cold reads where permitted
  bool as_json = false;
};

// Measures and prints a table (or JSON) of each floor's median. Exit code 0,
// 1 when a floor failed (e.g. no O_DIRECT on PATH's filesystem), 2 when PATH
// is not a local directory.
int CmdFloors(const FloorsCommandOptions& opts);

}  // namespace cairn::cli
