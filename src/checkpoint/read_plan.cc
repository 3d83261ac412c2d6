// Read planning (include/cairn/read_plan.h).
#include "cairn/read_plan.h"

#include <cstring>
#include <map>
#include <memory>
#include <string_view>
#include <utility>

#include "io/parallel.h"

namespace cairn {

Result<std::optional<ByteRange>> ChunkByteRange(std::span<const int64_t> offsets,
                                                std::span<const int64_t> lengths,
                                                std::span<const int64_t> sizes, uint64_t itemsize) {
  const size_t rank = sizes.size();
  if (offsets.size() != rank || lengths.size() != rank) {
    return InvalidArgumentError("read item and stored chunk differ in rank");
  }
  bool empty = false;
  for (size_t d = 0; d < rank; ++d) {
    int64_t o = offsets[d], n = lengths[d], s = sizes[d];
    if (o < 0 || n < 0 || s < 0 || o > s || n > s - o) {
      return InvalidArgumentError("read region at dimension " + std::to_string(d) + " (" +
                                  std::to_string(o) + "+" + std::to_string(n) +
                                  ") lies outside the stored chunk (" + std::to_string(s) + ")");
    }
    empty = empty || n == 0;
  }
  if (empty) return std::optional<ByteRange>(ByteRange{0, 0});
  // Contiguous iff every dimension before the last partial one has length 1.
  size_t last_partial = 0;
  bool any_partial = false;
  for (size_t d = 0; d < rank; ++d) {
    if (lengths[d] != sizes[d]) last_partial = d, any_partial = true;
  }
  for (size_t d = 0; any_partial && d < last_partial; ++d) {
    if (lengths[d] != 1) return std::optional<ByteRange>();
  }
  uint64_t linear = 0, numel = 1;
  for (size_t d = 0; d < rank; ++d) {
    if (__builtin_mul_overflow(linear, static_cast<uint64_t>(sizes[d]), &linear) ||
        __builtin_add_overflow(linear, static_cast<uint64_t>(offsets[d]), &linear) ||
        __builtin_mul_overflow(numel, static_cast<uint64_t>(lengths[d]), &numel)) {
      return InvalidArgumentError("read region overflows");
    }
  }
  ByteRange r;
  if (__builtin_mul_overflow(linear, itemsize, &r.offset) ||
      __builtin_mul_overflow(numel, itemsize, &r.size)) {
    return InvalidArgumentError("read region overflows");
  }
  return std::optional<ByteRange>(r);
}

ItemIndex::ItemIndex(const Manifest& m) : m_(m) {
  for (uint32_t i = 0; i < m.tensors.size(); ++i) {
    tensors_[m.tensors[i].fqn] = i;
    for (uint32_t c = 0; c < m.tensors[i].chunks.size(); ++c) {
      chunks_[{m.tensors[i].fqn, m.tensors[i].chunks[c].offsets}] = {ItemRef::Kind::kTensorChunk, i,
                                                                     c};
    }
  }
  for (uint32_t i = 0; i < m.bytes.size(); ++i) bytes_[m.bytes[i].fqn] = i;
}

std::optional<ItemRef> ItemIndex::Chunk(const std::string& fqn,
                                        const std::vector<uint64_t>& offsets) const {
  auto it = chunks_.find({fqn, offsets});
  if (it == chunks_.end()) return std::nullopt;
  return it->second;
}

std::optional<ItemRef> ItemIndex::Bytes(const std::string& fqn) const {
  auto it = bytes_.find(fqn);
  if (it == bytes_.end()) return std::nullopt;
  return ItemRef{ItemRef::Kind::kBytes, it->second, 0};
}

std::optional<ItemRef> ItemIndex::OnlyChunk(const std::string& fqn) const {
  auto it = tensors_.find(fqn);
  if (it == tensors_.end() || m_.tensors[it->second].chunks.size() != 1) return std::nullopt;
  return ItemRef{ItemRef::Kind::kTensorChunk, it->second, 0};
}

std::optional<std::vector<ReadRequest>> PlanInPlaceRead(const Manifest& m, const ItemIndex& index,
                                                        std::span<const InPlaceTarget> targets) {
  std::vector<ReadRequest> out;
  out.reserve(targets.size());
  for (const InPlaceTarget& t : targets) {
    ReadRequest r;
    if (!t.tensor) {
      std::optional<ItemRef> item = index.Bytes(t.fqn);
      if (!item) return std::nullopt;  // absent, or stored as a tensor
      r.item = *item;
      r.size = m.bytes[item->index].location.length;
      out.push_back(r);
      continue;
    }
    std::optional<ItemRef> item = index.OnlyChunk(t.fqn);
    if (!item) return std::nullopt;  // absent, a bytes item, or in several chunks
    const ManifestTensor& mt = m.tensors[item->index];
    const TensorChunk& c = mt.chunks[0];
    if (mt.dtype != t.dtype || mt.shape != t.shape || c.sizes != t.shape ||
        c.location.length != t.nbytes) {
      return std::nullopt;
    }
    for (uint64_t o : c.offsets) {
      if (o != 0) return std::nullopt;
    }
    r.item = *item;
    r.dest = t.data;
    r.size = t.nbytes;
    out.push_back(r);
  }
  return out;
}

namespace {

// Copies the box `o + l` of the row-major chunk at `src` (shape `s`, elements
// of `e` bytes) to `dst`, one run of contiguous bytes at a time. The box is
// not one contiguous range (ChunkByteRange said so), so some dimension
// before the trailing full ones is partial.
void CopyBox(const char* src, const std::vector<uint64_t>& s, std::span<const int64_t> o,
             std::span<const int64_t> l, uint64_t e, char* dst) {
  const size_t rank = s.size();
  size_t p = rank;  // dims [p, rank) are whole; dim p - 1 is partial
  while (p > 0 && static_cast<uint64_t>(l[p - 1]) == s[p - 1]) --p;
  std::vector<uint64_t> stride(rank);
  stride[rank - 1] = e;
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * s[d];
  const uint64_t run = static_cast<uint64_t>(l[p - 1]) * stride[p - 1];
  uint64_t rows = 1;
  for (size_t d = 0; d + 1 < p; ++d) rows *= static_cast<uint64_t>(l[d]);
  std::vector<uint64_t> idx(p - 1, 0);
  for (uint64_t row = 0; row < rows; ++row) {
    uint64_t off = static_cast<uint64_t>(o[p - 1]) * stride[p - 1];
    for (size_t d = 0; d + 1 < p; ++d) off += (static_cast<uint64_t>(o[d]) + idx[d]) * stride[d];
    std::memcpy(dst, src + off, run);
    dst += run;
    for (size_t d = p - 1; d-- > 0;) {
      if (++idx[d] < static_cast<uint64_t>(l[d])) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

Status ReadBoxes(CheckpointReader* reader, std::span<const BoxRead> boxes,
                 std::span<const ReadRequest> others, ThreadPool* pool) {
  const Manifest& m = reader->manifest();
  std::vector<ReadRequest> reqs(others.begin(), others.end());
  std::map<std::pair<uint32_t, uint32_t>, size_t> scratch_of;  // chunk -> scratch
  std::vector<std::unique_ptr<char[]>> scratch;
  std::vector<std::pair<const BoxRead*, size_t>> copies;  // (box, scratch)
  for (const BoxRead& b : boxes) {
    if (b.tensor >= m.tensors.size() || b.chunk >= m.tensors[b.tensor].chunks.size()) {
      return InvalidArgumentError("read of tensor " + std::to_string(b.tensor) + " chunk " +
                                  std::to_string(b.chunk) + ": not in the manifest");
    }
    const ManifestTensor& t = m.tensors[b.tensor];
    const TensorChunk& c = t.chunks[b.chunk];
    const uint64_t itemsize = format::DtypeItemSize(t.dtype);
    std::vector<int64_t> sizes(c.sizes.begin(), c.sizes.end());
    Result<std::optional<ByteRange>> range = ChunkByteRange(b.offsets, b.lengths, sizes, itemsize);
    if (!range.ok()) return range.status().WithContext("tensor '" + t.fqn + "'");
    uint64_t nbytes = itemsize;
    for (int64_t n : b.lengths) nbytes *= static_cast<uint64_t>(n);  // within the chunk
    if (nbytes != b.nbytes) {
      return InvalidArgumentError("tensor '" + t.fqn + "': a read of " + std::to_string(nbytes) +
                                  " bytes into " + std::to_string(b.nbytes));
    }
    if (nbytes == 0) continue;
    ItemRef ref{ItemRef::Kind::kTensorChunk, b.tensor, b.chunk};
    if (range->has_value()) {
      reqs.push_back({ref, b.dest, (*range)->size, (*range)->offset});
      continue;
    }
    auto [it, fresh] = scratch_of.try_emplace({b.tensor, b.chunk}, scratch.size());
    if (fresh) {
      scratch.emplace_back(new char[c.location.length]);
      reqs.push_back({ref, scratch.back().get(), c.location.length, 0});
    }
    copies.emplace_back(&b, it->second);
  }
  CAIRN_RETURN_IF_ERROR(reader->Read(reqs, pool));
  internal::ParallelFor(copies.size(), pool, 0, [&](size_t i) {
    const BoxRead& b = *copies[i].first;
    const ManifestTensor& t = m.tensors[b.tensor];
    CopyBox(scratch[copies[i].second].get(), t.chunks[b.chunk].sizes, b.offsets, b.lengths,
            format::DtypeItemSize(t.dtype), static_cast<char*>(b.dest));
  });
  return Status::OK();
}

}  // namespace cairn
