// The chaos harness's fault points (see cairn/chaos.h).
#include "cairn/chaos.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

namespace cairn {
namespace {

struct ChaosSpec {
  std::string phase;
  long n = 0;
  std::optional<std::set<long>> ranks;  // nullopt: every rank
};

std::string Env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// The armed spec, parsed once; nullopt when unset, in a restarted attempt, or
// malformed.
const std::optional<ChaosSpec>& Armed() {
  static const std::optional<ChaosSpec> spec = []() -> std::optional<ChaosSpec> {
    std::string s = Env("CAIRN_CHAOS", "");
    if (s.empty() || Env("TORCHELASTIC_RESTART_COUNT", "0") != "0") return std::nullopt;
    size_t a = s.find(':'), b = a == std::string::npos ? a : s.find(':', a + 1);
    if (b == std::string::npos) return std::nullopt;
    ChaosSpec c;
    c.phase = s.substr(0, a);
    c.n = std::strtol(s.c_str() + a + 1, nullptr, 10);
    std::string ranks = s.substr(b + 1);
    if (ranks != "all") {
      c.ranks.emplace();
      for (size_t p = 0; p <= ranks.size();) {
        size_t comma = ranks.find(',', p);
        if (comma == std::string::npos) comma = ranks.size();
        c.ranks->insert(std::strtol(ranks.substr(p, comma - p).c_str(), nullptr, 10));
        p = comma + 1;
      }
    }
    return c;
  }();
  return spec;
}

long Rank() { return std::strtol(Env("RANK", "0").c_str(), nullptr, 10); }

bool ForThisRank(const ChaosSpec& c) { return !c.ranks || c.ranks->count(Rank()) > 0; }

[[noreturn]] void Kill(const std::string& what) {
  std::string line = "[chaos] rank " + std::to_string(Rank()) + ": SIGKILL at " + what + "\n";
  ssize_t ignored = ::write(2, line.data(), line.size());
  (void)ignored;
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached
}

std::mutex mu;
std::map<std::string, long, std::less<>> counts;  // guarded by mu

}  // namespace

void ChaosPoint(std::string_view phase) {
  const auto& c = Armed();
  if (!c || c->phase != phase || !ForThisRank(*c)) return;
  bool hit;
  {
    std::lock_guard<std::mutex> lock(mu);
    hit = ++counts[std::string(phase)] == c->n;
  }
  if (hit) Kill(c->phase + " #" + std::to_string(c->n));
}

void ChaosArm() {
  const auto& c = Armed();
  if (!c || c->phase != "timer" || !ForThisRank(*c)) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (counts.count("timer")) return;
    counts["timer"] = 1;
  }
  long ms = c->n;
  // The timer is the point of the thread: it sleeps, then kills the process.
  std::thread([ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    Kill("timer " + std::to_string(ms) + "ms");
  }).detach();
}

}  // namespace cairn
