// Saves a few named buffers as a cairn checkpoint through the public C++ API,
// reloads them, checks they are identical, and verifies the checkpoint.
// No Python involved. Usage: example_save_load [DIR]  (default: a temp dir)
// Exit code 0 on success.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cairn/checkpoint.h"

int main(int argc, char** argv) {
  std::string root;
  if (argc > 1) {
    root = argv[1];
  } else {
    char tmpl[] = "/tmp/cairn_example_XXXXXX";
    if (!mkdtemp(tmpl)) return 2;
    root = tmpl;
  }

  // Some "model state": weights, a bias, a step counter.
  std::vector<float> weight(1024 * 300);
  std::iota(weight.begin(), weight.end(), 0.5f);
  std::vector<double> bias(300, -1.25);
  int64_t step = 1234;

  auto storage = cairn::OpenStorage(root);
  if (!storage.ok()) {
    std::fprintf(stderr, "%s\n", storage.status().ToString().c_str());
    return 1;
  }
  cairn::ThreadPool pool(4);
  std::vector<cairn::NamedBuffer> buffers = {
      {"model.weight", "float32", {1024, 300}, weight.data()},
      {"model.bias", "float64", {300}, bias.data()},
      {"step", "int64", {}, &step},
  };
  cairn::Status s = cairn::SaveBuffers(storage->get(), "step_1234", buffers, &pool);
  if (!s.ok()) {
    std::fprintf(stderr, "save: %s\n", s.ToString().c_str());
    return 1;
  }

  auto latest = cairn::LatestValid(storage->get(), "");
  if (!latest.ok() || !latest->has_value() || **latest != "step_1234") {
    std::fprintf(stderr, "latest_valid did not find step_1234\n");
    return 1;
  }
  s = cairn::Verify(storage->get(), "step_1234", &pool);
  if (!s.ok()) {
    std::fprintf(stderr, "verify: %s\n", s.ToString().c_str());
    return 1;
  }

  auto loaded = cairn::LoadBuffers(storage->get(), "step_1234", &pool);
  if (!loaded.ok()) {
    std::fprintf(stderr, "load: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  int bad = 0;
  for (const auto& b : *loaded) {
    const void* want = nullptr;
    size_t n = 0;
    if (b.name == "model.weight") want = weight.data(), n = weight.size() * sizeof(float);
    if (b.name == "model.bias") want = bias.data(), n = bias.size() * sizeof(double);
    if (b.name == "step") want = &step, n = sizeof(step);
    if (!want || b.data.size() != n || std::memcmp(b.data.data(), want, n) != 0) {
      std::fprintf(stderr, "mismatch in %s\n", b.name.c_str());
      ++bad;
    }
  }
  if (loaded->size() != buffers.size()) bad++;
  if (argc <= 1) {  // the temp dir is ours: leave nothing behind
    storage->get()->DeleteDir("").IgnoreError();
    rmdir(root.c_str());
  }
  if (bad) return 1;
  std::printf("saved, verified and reloaded %zu buffers\n", loaded->size());
  return 0;
}
