// ParallelCopy and ParallelCopyOut (include/cairn/staging.h): validate every
// span first, then copy them all in pieces spread over a ThreadPool.
#include <cstring>
#include <vector>

#include "cairn/staging.h"
#include "io/parallel.h"

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

void CopyPieces(const std::vector<Piece>& pieces, ThreadPool* pool) {
  internal::ParallelFor(pieces.size(), pool, 0,
                        [&](size_t i) { std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].n); });
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
                 Resolve resolve) {
  if (piece_bytes == 0) return InvalidArgumentError("copy piece size must be positive");
  size_t num_pieces = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    ResolvedSpan r = resolve(spans[i]);
    CAIRN_RETURN_IF_ERROR(
        CheckSpan(i, r.external, r.offset, spans[i].nbytes, size, piece_bytes, &num_pieces));
  }
  std::vector<Piece> pieces;
  pieces.reserve(num_pieces);
  for (const Span& s : spans) {
    ResolvedSpan r = resolve(s);
    AddPieces(r.src, r.dst, s.nbytes, piece_bytes, &pieces);
  }
  CopyPieces(pieces, pool);
  return Status::OK();
}

}  // namespace

Status ParallelCopy(void* dst, uint64_t dst_size, std::span<const CopySpan> spans, ThreadPool* pool,
                    uint64_t piece_bytes) {
  return CopySpans(dst_size, spans, pool, piece_bytes, [dst](const CopySpan& s) {
    return ResolvedSpan{s.src, s.dst_offset, static_cast<const char*>(s.src),
                        static_cast<char*>(dst) + s.dst_offset};
  });
}

Status ParallelCopyOut(const void* src, uint64_t src_size, std::span<const CopyOutSpan> spans,
                       ThreadPool* pool, uint64_t piece_bytes) {
  return CopySpans(src_size, spans, pool, piece_bytes, [src](const CopyOutSpan& s) {
    return ResolvedSpan{s.dst, s.src_offset, static_cast<const char*>(src) + s.src_offset,
                        static_cast<char*>(s.dst)};
  });
}

}  // namespace cairn
