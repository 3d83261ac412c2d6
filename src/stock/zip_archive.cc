// The zip records of one torch.save archive (see cairn/stock.h).
//
// torch.save writes a plain zip: stored entries, each behind a local header
// whose extra field pads the data to 64 bytes, then the central directory and
// the end-of-central-directory record (with zip64 records when the archive or
// an entry passes 4 GiB). The walk reads the end record (searching back over
// a comment of at most 64 KiB), the central directory, and then each entry's
// local header, because only the local header's own name and extra lengths
// say where the data begins. Every offset is checked against the archive's
// size before it is used, in 64-bit arithmetic that cannot wrap: a hostile
// archive yields kDataLoss, never a read outside the item.
#include <libdeflate.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cairn/stock.h"

namespace cairn::stock {
namespace {

constexpr uint32_t kLocalMagic = 0x04034b50;
constexpr uint32_t kCentralMagic = 0x02014b50;
constexpr uint32_t kEndMagic = 0x06054b50;
constexpr uint32_t kEnd64Magic = 0x06064b50;
constexpr uint32_t kEnd64LocatorMagic = 0x07064b50;
constexpr size_t kLocalHeaderSize = 30;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kEndSize = 22;
constexpr size_t kEnd64Size = 56;
constexpr size_t kEnd64LocatorSize = 20;
constexpr size_t kMaxComment = 0xffff;
// torch.save writes a handful of entries; a directory claiming more than this
// is not one of its archives.
constexpr uint64_t kMaxEntries = 1 << 16;

uint16_t U16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
uint32_t U32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t U64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

Status NotAnArchive(std::string_view why) {
  return DataLossError("not a torch.save archive (" + std::string(why) + ")");
}

// Reads [offset, offset + n) of `f`, which must lie inside it.
Status ReadRange(const ReadableFile& f, uint64_t offset, uint64_t n, std::string* out) {
  if (offset > f.Size() || n > f.Size() - offset) return NotAnArchive("record out of range");
  out->resize(n);
  return f.ReadAt(offset, out->data(), n);
}

// The zip64 extended-information extra field of a central header: replaces
// the 32-bit fields that hold 0xffffffff, in their fixed order.
Status ApplyZip64Extra(std::string_view extra, uint64_t* csize, uint64_t* usize,
                       uint64_t* header_offset) {
  size_t at = 0;
  while (at + 4 <= extra.size()) {
    uint16_t id = U16(extra.data() + at);
    uint16_t len = U16(extra.data() + at + 2);
    if (at + 4 + len > extra.size()) break;
    if (id == 0x0001) {
      std::string_view f = extra.substr(at + 4, len);
      size_t k = 0;
      for (uint64_t* v : {usize, csize, header_offset}) {
        if (*v != 0xffffffffu) continue;
        if (k + 8 > f.size()) return NotAnArchive("short zip64 extra field");
        *v = U64(f.data() + k);
        k += 8;
      }
      return Status::OK();
    }
    at += 4 + len;
  }
  if (*csize == 0xffffffffu || *usize == 0xffffffffu || *header_offset == 0xffffffffu) {
    return NotAnArchive("missing zip64 extra field");
  }
  return Status::OK();
}

}  // namespace

Status MemoryFile::ReadAt(uint64_t offset, void* buf, size_t n) const {
  if (offset > n_ || n > n_ - offset) return OutOfRangeError("read past the end of the buffer");
  if (n > 0) std::memcpy(buf, data_ + offset, n);
  return Status::OK();
}

Status FileRange::ReadAt(uint64_t offset, void* buf, size_t n) const {
  if (offset > length_ || n > length_ - offset) return OutOfRangeError("read past the item");
  return file_->ReadAt(offset_ + offset, buf, n);
}

uint32_t Crc32(uint32_t crc, const void* data, uint64_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {  // in steps of 1 GiB: size_t is wide, but keep the calls short
    const size_t step = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    crc = libdeflate_crc32(crc, p, step);
    p += step;
    n -= step;
  }
  return crc;
}

Status VerifyEntry(const ZipEntry& entry, const void* data, uint64_t n) {
  if (Crc32(0, data, n) != entry.crc32) {
    return DataLossError("checksum mismatch in " + entry.name +
                         " (if it was saved with CRC32 disabled, pass verify_crc=False)");
  }
  return Status::OK();
}

Result<std::vector<ZipEntry>> ReadZipDirectory(const ReadableFile& archive) {
  const uint64_t size = archive.Size();
  if (size < kEndSize) return NotAnArchive("too short");
  // 1. The end record: the last "PK\5\6" whose comment reaches the end.
  const uint64_t tail_len = std::min<uint64_t>(size, kEndSize + kMaxComment);
  std::string tail;
  CAIRN_RETURN_IF_ERROR(ReadRange(archive, size - tail_len, tail_len, &tail));
  int64_t end_at = -1;
  for (int64_t i = static_cast<int64_t>(tail_len - kEndSize); i >= 0; --i) {
    if (U32(tail.data() + i) == kEndMagic && i + kEndSize + U16(tail.data() + i + 20) == tail_len) {
      end_at = i;
      break;
    }
  }
  if (end_at < 0) return NotAnArchive("no end of central directory");
  const char* end = tail.data() + end_at;
  const uint64_t end_pos = size - tail_len + end_at;
  uint64_t count = U16(end + 10);
  uint64_t cd_size = U32(end + 12);
  uint64_t cd_offset = U32(end + 16);
  uint64_t records_begin = end_pos;  // where the central directory must end
  // 2. zip64: a locator right before the end record points at the zip64 end
  // record, which then holds the real counts (torch.save always writes both).
  std::string loc;
  if (end_pos >= kEnd64LocatorSize) {
    CAIRN_RETURN_IF_ERROR(ReadRange(archive, end_pos - kEnd64LocatorSize, kEnd64LocatorSize, &loc));
  }
  if (!loc.empty() && U32(loc.data()) == kEnd64LocatorMagic) {
    uint64_t end64_pos = U64(loc.data() + 8);
    if (end64_pos > end_pos - kEnd64LocatorSize) return NotAnArchive("bad zip64 locator");
    std::string end64;
    CAIRN_RETURN_IF_ERROR(ReadRange(archive, end64_pos, kEnd64Size, &end64));
    if (U32(end64.data()) != kEnd64Magic) return NotAnArchive("bad zip64 end record");
    count = U64(end64.data() + 32);
    cd_size = U64(end64.data() + 40);
    cd_offset = U64(end64.data() + 48);
    records_begin = end64_pos;
  } else if (count == 0xffff || cd_size == 0xffffffffu || cd_offset == 0xffffffffu) {
    return NotAnArchive("no zip64 locator");
  }
  if (count > kMaxEntries) return NotAnArchive("too many entries");
  if (cd_offset > records_begin || cd_size != records_begin - cd_offset) {
    return NotAnArchive("central directory out of place");
  }
  // 3. The central directory (usually inside the tail already read).
  std::string cd_buf;
  std::string_view cd;
  const uint64_t tail_begin = size - tail_len;
  if (cd_offset >= tail_begin) {
    cd = std::string_view(tail).substr(cd_offset - tail_begin, cd_size);
  } else {
    CAIRN_RETURN_IF_ERROR(ReadRange(archive, cd_offset, cd_size, &cd_buf));
    cd = cd_buf;
  }
  std::vector<ZipEntry> entries;
  entries.reserve(count);
  size_t at = 0;
  std::string local;
  for (uint64_t i = 0; i < count; ++i) {
    if (at + kCentralHeaderSize > cd.size() || U32(cd.data() + at) != kCentralMagic) {
      return NotAnArchive("bad central directory");
    }
    const char* h = cd.data() + at;
    ZipEntry e;
    e.method = U16(h + 10);
    e.crc32 = U32(h + 16);
    uint64_t csize = U32(h + 20), usize = U32(h + 24), header_offset = U32(h + 42);
    size_t name_len = U16(h + 28), extra_len = U16(h + 30), comment_len = U16(h + 32);
    if (at + kCentralHeaderSize + name_len + extra_len + comment_len > cd.size()) {
      return NotAnArchive("bad central directory");
    }
    e.name.assign(h + kCentralHeaderSize, name_len);
    CAIRN_RETURN_IF_ERROR(ApplyZip64Extra(cd.substr(at + kCentralHeaderSize + name_len, extra_len),
                                          &csize, &usize, &header_offset));
    at += kCentralHeaderSize + name_len + extra_len + comment_len;
    // 4. The local header: its own name and extra lengths place the data.
    if (header_offset > size || kLocalHeaderSize > size - header_offset) {
      return DataLossError("zip entry " + e.name + " out of range");
    }
    local.resize(kLocalHeaderSize);
    CAIRN_RETURN_IF_ERROR(archive.ReadAt(header_offset, local.data(), kLocalHeaderSize));
    if (U32(local.data()) != kLocalMagic) {
      return DataLossError("zip entry " + e.name + " has a bad header");
    }
    e.data_begin =
        header_offset + kLocalHeaderSize + U16(local.data() + 26) + U16(local.data() + 28);
    e.size = csize;
    if (e.data_begin > size || e.size > size - e.data_begin) {
      return DataLossError("zip entry " + e.name + " is truncated");
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

}  // namespace cairn::stock
