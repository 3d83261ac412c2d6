// The engine's one include of xxHash. On x86-64, XXH3_64bits and
// XXH3_64bits_update are replaced by libxxhash's runtime dispatch
// (xxh_x86dispatch.h), which picks the AVX512, AVX2 or SSE2 kernel this CPU
// has: the library is built for the x86-64 baseline, whose SSE2 kernel hashed
// at a third of the AVX2 one here (9 vs 27 GB/s on cached data), and every
// save, load, restore and verify hashes each byte once. The digests are the
// same, whichever kernel computes them.
#pragma once

#include <xxhash.h>

#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>
#endif
