// `cairn ls --memory` and `cairn gc`: the node's memory tiers (see
// include/cairn/memory_tier.h), implemented in memory_commands.cc.
#pragma once

#include <cstdint>
#include <string>

#include "cairn/memory_tier.h"

namespace cairn::cli {

struct MemoryCommandOptions {
  std::string shm_root;  // empty = /dev/shm
  double grace_seconds = 0;
  bool dry_run = false;
  bool as_json = false;
};

// Lists the node's memory tiers and replicas: size, step, run root, owner,
// state. Exit code 0, or 1 when the shared-memory root cannot be read.
int CmdLsMemory(const MemoryCommandOptions& opts);

// Deletes orphaned memory tiers and prints what was freed.
int CmdGc(const MemoryCommandOptions& opts);

// `n` bytes for people: "512 B", "1.5 MiB" (every command of the CLI prints sizes so;
// the library's, include/cairn/memory_tier.h).
using cairn::HumanBytes;

}  // namespace cairn::cli
