// ParallelCopy and ParallelCopyOut (include/cairn/staging.h): validate every
// span first, then copy them all in pieces spread over a ThreadPool.
//
// Why ParallelCopy streams. A staging copy writes far more bytes than the
// caches hold, into a slot that nobody reads until the background checksum.
// memcpy of a piece of a few MiB (a typical tensor) uses ordinary stores
// below glibc's non-temporal threshold, so every destination line is first
// read into the cache (read-for-ownership) and later evicted: three memory
// passes for two. One memcpy of the whole state crosses the threshold and
// streams, which is why it measured ~1.5x faster than per-tensor memcpys.
// So pieces of at least kStreamMinBytes are copied with non-temporal stores
// (internal::StreamCopy, fenced before it returns).
#include <cstring>
#include <vector>

#include "cairn/staging.h"
#include "io/parallel.h"
#include "io/stream_copy.h"

namespace cairn {

namespace {

struct Piece {
  const char* src;
  char* dst;
  size_t n;
};

// Checks one span against a buffer of `size` bytes; counts its pieces.
Status CheckSpan(size_t i, const void* ptr, uint64_t offset, uint64_t nbytes, uint64_t size,
                 uint64_t piece_bytes, size_t* num_pieces) {
  if (nbytes == 0) return Status::OK();
  if (!ptr) return InvalidArgumentError("copy span " + std::to_string(i) + ": null pointer");
  if (offset > size || size - offset < nbytes) {
    return OutOfRangeError("copy span " + std::to_string(i) + ": " + std::to_string(nbytes) +
                           " bytes at offset " + std::to_string(offset) +
                           " do not fit a buffer of " + std::to_string(size) + " bytes");
  }
  *num_pieces += static_cast<size_t>((nbytes + piece_bytes - 1) / piece_bytes);
  return Status::OK();
}

void AddPieces(const char* src, char* dst, uint64_t nbytes, uint64_t piece_bytes,
               std::vector<Piece>* out) {
  for (uint64_t off = 0; off < nbytes; off += piece_bytes) {
    out->push_back(
        Piece{src + off, dst + off, static_cast<size_t>(std::min(piece_bytes, nbytes - off))});
  }
}

// Pieces smaller than this are memcpy'd: streaming pays off only past the
// caches' reach, and small items are often read again soon.
constexpr size_t kStreamMinBytes = size_t{256} << 10;

void CopyPieces(const std::vector<Piece>& pieces, uint64_t total, ThreadPool* pool, bool stream) {
  // A small copy (a few MiB: checkpointing every step) runs on the calling
  // thread. Waking the helpers costs tens of microseconds when the machine is
  // idle and milliseconds when it is loaded, more than they save at this size.
  // Such a copy stays in the caches, so it is not streamed either.
  if (total < internal::kInlineCopyBytes) {
    pool = nullptr;
    stream = false;
  }
  internal::ParallelFor(pieces.size(), pool, 0, [&](size_t i) {
    const Piece& p = pieces[i];
    if (stream && p.n >= kStreamMinBytes) {
      internal::StreamCopy(p.dst, p.src, p.n);  // fenced: visible before it reports done
    } else {
      std::memcpy(p.dst, p.src, p.n);
    }
  });
}

// One span of a copy, resolved: the caller's pointer (checked for null), the
// offset into the staging buffer (checked against its size), and the ends.
struct ResolvedSpan {
  const void* external;
  uint64_t offset;
  const char* src;
  char* dst;
};

// Validates every span first (a bad span copies nothing), then copies them all
// in pieces on `pool`. `resolve(span)` gives the span's ResolvedSpan.
template <typename Span, typename Resolve>
Status CopySpans(uint64_t size, std::span<const Span> spans, ThreadPool* pool, uint64_t piece_bytes,
                 bool stream, Resolve resolve) {
  if (piece_bytes == 0) return InvalidArgumentError("copy piece size must be positive");
  size_t num_pieces = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    ResolvedSpan r = resolve(spans[i]);
    CAIRN_RETURN_IF_ERROR(
        CheckSpan(i, r.external, r.offset, spans[i].nbytes, size, piece_bytes, &num_pieces));
  }
  std::vector<Piece> pieces;
  pieces.reserve(num_pieces);
  uint64_t total = 0;
  for (const Span& s : spans) {
    ResolvedSpan r = resolve(s);
    AddPieces(r.src, r.dst, s.nbytes, piece_bytes, &pieces);
    total += s.nbytes;
  }
  CopyPieces(pieces, total, pool, stream);
  return Status::OK();
}

}  // namespace

Status ParallelCopy(void* dst, uint64_t dst_size, std::span<const CopySpan> spans, ThreadPool* pool,
                    uint64_t piece_bytes) {
  return CopySpans(dst_size, spans, pool, piece_bytes, /*stream=*/true, [dst](const CopySpan& s) {
    return ResolvedSpan{s.src, s.dst_offset, static_cast<const char*>(s.src),
                        static_cast<char*>(dst) + s.dst_offset};
  });
}

Status ParallelCopyOut(const void* src, uint64_t src_size, std::span<const CopyOutSpan> spans,
                       ThreadPool* pool, uint64_t piece_bytes) {
  return CopySpans(
      src_size, spans, pool, piece_bytes, /*stream=*/false, [src](const CopyOutSpan& s) {
        return ResolvedSpan{s.dst, s.src_offset, static_cast<const char*>(src) + s.src_offset,
                            static_cast<char*>(s.dst)};
      });
}

}  // namespace cairn
