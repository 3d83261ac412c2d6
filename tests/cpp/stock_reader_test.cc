// The stock-checkpoint reader (cairn/stock.h): torch.save archives built here
// byte for byte as torch.save writes them, then damaged in every way a
// hostile or broken file can be.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cairn/stock.h"

namespace cairn::stock {
namespace {

void Put16(std::string* s, uint16_t v) { s->append(reinterpret_cast<const char*>(&v), 2); }
void Put32(std::string* s, uint32_t v) { s->append(reinterpret_cast<const char*>(&v), 4); }

// data.pkl of torch.save(tensor) for the given geometry (protocol 2).
std::string TensorPickle(const std::string& storage_class, int64_t numel, int64_t offset,
                         const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                         const std::string& global = "torch._utils\n_rebuild_tensor_v2\n") {
  auto int_op = [](std::string* s, int64_t v) {
    s->push_back('J');
    Put32(s, static_cast<uint32_t>(v));
  };
  auto str_op = [](std::string* s, const std::string& v) {
    s->push_back('X');
    Put32(s, static_cast<uint32_t>(v.size()));
    *s += v;
  };
  std::string p = "\x80\x02";
  p += "c" + global;
  p.append("q\0", 2);  // BINPUT 0
  p += "((";
  str_op(&p, "storage");
  p += "ctorch\n" + storage_class + "\nq\x01";
  str_op(&p, "0");
  str_op(&p, "cpu");
  int_op(&p, numel);
  p += "tQ";
  int_op(&p, offset);
  p += "(";
  for (int64_t d : size) int_op(&p, d);
  p += "t(";
  for (int64_t d : stride) int_op(&p, d);
  p += "t\x89";
  p += "ccollections\nOrderedDict\n)R";
  p += "tR.";
  return p;
}

struct Entry {
  std::string name, data;
  uint16_t method = 0;
};

void Put64(std::string* s, uint64_t v) { s->append(reinterpret_cast<const char*>(&v), 8); }

// What a local header and its central-directory header share: method,
// time and date (0), crc, both sizes (stored), name length.
void PutEntryFields(std::string* out, const Entry& e, uint32_t crc) {
  Put16(out, e.method);
  Put32(out, 0);
  Put32(out, crc);
  Put32(out, e.data.size());
  Put32(out, e.data.size());
  Put16(out, e.name.size());
}

// A zip as torch.save writes it: stored entries, data 64-byte aligned, and
// (zip64) the zip64 end record and locator torch.save always adds.
std::string Zip(const std::vector<Entry>& entries, bool zip64 = false) {
  std::string out, cd;
  for (const Entry& e : entries) {
    const uint32_t crc = static_cast<uint32_t>(
        crc32(0, reinterpret_cast<const Bytef*>(e.data.data()), e.data.size()));
    const uint32_t offset = out.size();
    size_t pad = (64 - (out.size() + 30 + e.name.size() + 4) % 64) % 64;
    std::string extra;
    Put16(&extra, 0x4246);  // "FB", torch's padding field
    Put16(&extra, static_cast<uint16_t>(pad));
    extra.append(pad, 'Z');
    Put32(&out, 0x04034b50);
    Put16(&out, 20);
    Put16(&out, 0);
    PutEntryFields(&out, e, crc);
    Put16(&out, extra.size());
    out += e.name + extra + e.data;
    Put32(&cd, 0x02014b50);
    Put16(&cd, 20);
    Put16(&cd, 20);
    Put16(&cd, 0);
    PutEntryFields(&cd, e, crc);
    Put16(&cd, 0);
    Put16(&cd, 0);
    Put16(&cd, 0);
    Put16(&cd, 0);
    Put32(&cd, 0);
    Put32(&cd, offset);
    cd += e.name;
  }
  const uint32_t cd_offset = out.size();
  out += cd;
  if (zip64) {
    const uint64_t end64 = out.size();
    Put32(&out, 0x06064b50);
    Put64(&out, 44);
    Put16(&out, 45);
    Put16(&out, 45);
    Put32(&out, 0);
    Put32(&out, 0);
    Put64(&out, entries.size());
    Put64(&out, entries.size());
    Put64(&out, cd.size());
    Put64(&out, cd_offset);
    Put32(&out, 0x07064b50);
    Put32(&out, 0);
    Put64(&out, end64);
    Put32(&out, 1);
  }
  Put32(&out, 0x06054b50);
  Put16(&out, 0);
  Put16(&out, 0);
  Put16(&out, entries.size());
  Put16(&out, entries.size());
  Put32(&out, cd.size());
  Put32(&out, cd_offset);
  Put16(&out, 0);
  return out;
}

std::string Floats(int n, float base = 0) {
  std::string s(n * 4, '\0');
  for (int i = 0; i < n; ++i) {
    float v = base + i;
    std::memcpy(s.data() + 4 * i, &v, 4);
  }
  return s;
}

// torch.save(torch.arange(12.).reshape(3, 4)) with the given data.pkl.
std::string Archive(const std::string& pickle, const std::string& storage = Floats(12)) {
  return Zip({{"archive/data.pkl", pickle},
              {"archive/.format_version", "1"},
              {"archive/byteorder", "little"},
              {"archive/data/0", storage},
              {"archive/version", "3\n"}});
}

std::string Plain() { return Archive(TensorPickle("FloatStorage", 12, 0, {3, 4}, {4, 1})); }

Result<TensorRecord> Decode(const std::string& archive, bool verify_crc = true) {
  MemoryFile f(archive.data(), archive.size());
  CAIRN_ASSIGN_OR_RETURN(auto entries, ReadZipDirectory(f));
  return DecodeTensorRecord(f, entries, verify_crc);
}

TEST(StockRecordTest, DecodesThePlainOneTensorForm) {
  std::string a = Plain();
  auto rec = Decode(a);
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->dtype, "float32");
  EXPECT_EQ(rec->itemsize, 4u);
  EXPECT_EQ(rec->storage_numel, 12u);
  EXPECT_EQ(rec->size, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(rec->stride, (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(rec->storage.data_begin % 64, 0u);
  EXPECT_EQ(a.substr(rec->storage.data_begin, 48), Floats(12));
  EXPECT_TRUE(VerifyEntry(rec->storage, a.data() + rec->storage.data_begin, 48).ok());
}

TEST(StockRecordTest, ReadsTheZip64RecordsTorchSaveWrites) {
  std::vector<Entry> entries = {
      {"archive/data.pkl", TensorPickle("FloatStorage", 12, 0, {3, 4}, {4, 1})},
      {"archive/byteorder", "little"},
      {"archive/data/0", Floats(12)}};
  std::string a = Zip(entries, /*zip64=*/true);
  auto rec = Decode(a);
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(a.substr(rec->storage.data_begin, 48), Floats(12));
  // A locator pointing past itself is corruption, not a read elsewhere.
  size_t loc = a.rfind(std::string("PK\x06\x07", 4));
  uint64_t far = a.size() + 100;
  std::memcpy(a.data() + loc + 8, &far, 8);
  EXPECT_EQ(Decode(a).status().code(), StatusCode::kDataLoss);
}

TEST(StockRecordTest, KeepsATransposedView) {
  auto rec = Decode(Archive(TensorPickle("FloatStorage", 12, 0, {4, 3}, {1, 4})));
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->size, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(rec->stride, (std::vector<int64_t>{1, 4}));
}

TEST(StockRecordTest, UnknownGlobalIsNotSimpleNotCorruption) {
  auto rec = Decode(Archive(TensorPickle("FloatStorage", 12, 0, {3, 4}, {4, 1}, "os\nsystem\n")));
  EXPECT_EQ(rec.status().code(), StatusCode::kUnimplemented);
  auto f8 = Decode(Archive(TensorPickle("Float8Storage", 12, 0, {3, 4}, {4, 1})));
  EXPECT_EQ(f8.status().code(), StatusCode::kUnimplemented);
}

TEST(StockRecordTest, CompressedEntryIsNotSimple) {
  auto rec = Decode(Zip({{"archive/data.pkl", TensorPickle("FloatStorage", 12, 0, {12}, {1})},
                         {"archive/data/0", Floats(12), 8}}));
  EXPECT_EQ(rec.status().code(), StatusCode::kUnimplemented);
}

TEST(StockRecordTest, ViewBeyondItsStorageIsDataLoss) {
  auto rec = Decode(Archive(TensorPickle("FloatStorage", 12, 1, {3, 4}, {4, 1})));
  EXPECT_EQ(rec.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(rec.status().message().find("exceeds its storage"), std::string::npos);
  auto huge = Decode(Archive(TensorPickle("FloatStorage", 12, 0, {2, 2}, {1 << 30, 1})));
  EXPECT_EQ(huge.status().code(), StatusCode::kDataLoss);
}

TEST(StockRecordTest, StorageOfTheWrongSizeIsDataLoss) {
  auto rec = Decode(Archive(TensorPickle("FloatStorage", 12, 0, {3, 4}, {4, 1}), Floats(11)));
  EXPECT_EQ(rec.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(rec.status().message().find("wrong size"), std::string::npos);
  auto neg = Decode(Archive(TensorPickle("FloatStorage", 12, 0, {3, -4}, {4, 1})));
  EXPECT_EQ(neg.status().code(), StatusCode::kDataLoss);
}

TEST(StockRecordTest, DamagedPickleChecksumIsDataLoss) {
  std::string a = Plain();
  a[a.find("_rebuild_tensor_v2") + 3] ^= 1;  // inside data.pkl
  auto rec = Decode(a, /*verify_crc=*/true);
  EXPECT_EQ(rec.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(rec.status().message().find("checksum mismatch in archive/data.pkl"),
            std::string::npos);
}

TEST(StockRecordTest, TruncatedArchiveIsDataLoss) {
  std::string a = Plain();
  for (size_t n : {size_t{0}, size_t{10}, a.size() / 2, a.size() - 1}) {
    MemoryFile f(a.data(), n);
    EXPECT_EQ(ReadZipDirectory(f).status().code(), StatusCode::kDataLoss) << n;
  }
}

TEST(StockRecordTest, LocalHeaderOffsetBeyondTheArchiveIsDataLoss) {
  std::string a = Plain();
  // The last central header's local-header offset (4 bytes before its name).
  size_t at = a.rfind("archive/version") - 4;
  uint32_t far = 1u << 30;
  std::memcpy(a.data() + at, &far, 4);
  MemoryFile f(a.data(), a.size());
  auto entries = ReadZipDirectory(f);
  EXPECT_EQ(entries.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(entries.status().message().find("out of range"), std::string::npos);
}

TEST(StockRecordTest, RandomDamageDecodesOrFailsCleanly) {
  const std::string good = Plain();
  std::mt19937 rng(7);
  int errors = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string a = good;
    for (int k = 0; k < 1 + trial % 4; ++k) a[rng() % a.size()] = static_cast<char>(rng());
    auto rec = Decode(a, /*verify_crc=*/trial % 2 == 0);
    if (!rec.ok()) {
      ++errors;
      continue;
    }
    // Whatever decodes stays inside its storage and the archive.
    ASSERT_LE(rec->storage.data_begin + rec->storage.size, a.size());
    ASSERT_EQ(rec->storage.size, rec->storage_numel * rec->itemsize);
  }
  EXPECT_GT(errors, 500);
}

// ---- ReadTensors: items in a data file, into destinations -------------------

class StockReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    storage_ = NewMemStorage();
    // Two items in one data file, as FileSystemWriter lays them out.
    item0_ = Plain();
    item1_ = Archive(TensorPickle("FloatStorage", 12, 0, {4, 3}, {1, 4}), Floats(12, 100));
    Write(item0_ + item1_);
  }
  void Write(const std::string& bytes) {
    auto f = storage_->NewWritableFile("__0_0.distcp");
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->WriteAt(0, bytes.data(), bytes.size()).ok());
    ASSERT_TRUE((*f)->Close().ok());
  }
  TensorRequest Request(const std::string& item, uint64_t offset, std::vector<int64_t> chunk,
                        std::vector<float>* dest) {
    TensorRequest r;
    r.file = "__0_0.distcp";
    r.offset = offset;
    r.length = item.size();
    r.where = "__0_0.distcp: tensor 'w'";
    r.fqn = "'w'";
    r.dtype = "float32";
    r.chunk_size = chunk;
    r.slice_offset.assign(chunk.size(), 0);
    r.slice_length = chunk;
    dest->assign(12, -1);
    r.dest = dest->data();
    r.dest_stride = chunk.size() == 2 ? std::vector<int64_t>{chunk[1], 1} : std::vector<int64_t>{1};
    return r;
  }
  Status Read(const std::vector<TensorRequest>& reqs, bool verify_crc = true) {
    return ReadTensors(storage_.get(), reqs, &pool_, verify_crc, &fallback_);
  }

  std::unique_ptr<Storage> storage_;
  std::string item0_, item1_;
  ThreadPool pool_{4};
  std::vector<bool> fallback_;
};

TEST_F(StockReadTest, ReadsWholeItemsStraightIntoTheirDestinations) {
  std::vector<float> a, b;
  ASSERT_TRUE(
      Read({Request(item0_, 0, {3, 4}, &a), Request(item1_, item0_.size(), {4, 3}, &b)}).ok());
  EXPECT_EQ(fallback_, (std::vector<bool>{false, false}));
  for (int i = 0; i < 12; ++i) EXPECT_EQ(a[i], i);
  // item1 is the transpose: element (r, c) is storage[r + 4c].
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 3; ++c) EXPECT_EQ(b[r * 3 + c], 100 + r + 4 * c);
  }
}

TEST_F(StockReadTest, ReadsASliceIntoAStridedDestination) {
  std::vector<float> a;
  TensorRequest r = Request(item0_, 0, {3, 4}, &a);
  r.slice_offset = {1, 1};
  r.slice_length = {2, 2};
  r.dest_stride = {1, 2};  // column-major 2x2
  ASSERT_TRUE(Read({r}).ok());
  EXPECT_EQ(a[0], 5);  // (1,1)
  EXPECT_EQ(a[1], 9);  // (2,1)
  EXPECT_EQ(a[2], 6);  // (1,2)
  EXPECT_EQ(a[3], 10);
  EXPECT_EQ(a[4], -1);  // nothing beyond the slice
}

TEST_F(StockReadTest, FlippedStorageByteIsAChecksumMismatchNamingTheTensor) {
  std::string bad = item0_;
  bad[bad.find(Floats(12)) + 5] ^= 0x40;
  Write(bad);
  std::vector<float> a;
  Status s = Read({Request(bad, 0, {3, 4}, &a)});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("tensor 'w': checksum mismatch in archive/data/0"), std::string::npos)
      << s.message();
  EXPECT_TRUE(Read({Request(bad, 0, {3, 4}, &a)}, /*verify_crc=*/false).ok());
}

TEST_F(StockReadTest, ItemBeyondTheEndOfTheFileIsTruncation) {
  std::vector<float> a;
  TensorRequest r = Request(item0_, 1 << 20, {3, 4}, &a);
  Status s = Read({r});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("'w': data file is truncated"), std::string::npos) << s.message();
  r.offset = ~uint64_t{0} - 4;  // offset + length wraps
  EXPECT_EQ(Read({r}).code(), StatusCode::kDataLoss);
}

TEST_F(StockReadTest, TruncatedDataFileIsDataLoss) {
  Write(item0_.substr(0, item0_.size() / 2));
  std::vector<float> a;
  EXPECT_EQ(Read({Request(item0_, 0, {3, 4}, &a)}).code(), StatusCode::kDataLoss);
}

TEST_F(StockReadTest, WrongSizesAgainstTheMetadataAreDataLoss) {
  std::vector<float> a;
  TensorRequest r = Request(item0_, 0, {3, 4}, &a);
  r.chunk_size = {4, 3};
  Status s = Read({r});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("stored chunk is torch.float32[3, 4], metadata says "
                             "torch.float32[4, 3]"),
            std::string::npos)
      << s.message();
  r = Request(item0_, 0, {3, 4}, &a);
  r.slice_offset = {2, 0};  // rows 2..4 of 3
  EXPECT_EQ(Read({r}).code(), StatusCode::kDataLoss);
  r = Request(item0_, 0, {3, 4}, &a);
  r.dtype = "bfloat16";
  EXPECT_EQ(Read({r}).code(), StatusCode::kDataLoss);
}

TEST_F(StockReadTest, MissingDataFileIsNamed) {
  std::vector<float> a;
  TensorRequest r = Request(item0_, 0, {3, 4}, &a);
  r.file = "__1_0.distcp";
  Status s = Read({r});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("__1_0.distcp: data file of tensor 'w' is missing"), std::string::npos)
      << s.message();
}

TEST_F(StockReadTest, ArchiveInAnotherFormFallsBackWithoutWriting) {
  std::string other = Archive(TensorPickle("Float8_e4m3fnStorage", 12, 0, {3, 4}, {4, 1}));
  Write(other);
  std::vector<float> a;
  ASSERT_TRUE(Read({Request(other, 0, {3, 4}, &a)}).ok());
  EXPECT_EQ(fallback_, std::vector<bool>{true});
  EXPECT_EQ(a[0], -1);
}

TEST_F(StockReadTest, LargeItemIsReadInPiecesAndVerified) {
  const int n = (40 << 20) / 4;  // 40 MiB: three pieces
  std::string big = Archive(TensorPickle("FloatStorage", n, 0, {n}, {1}), Floats(n));
  Write(big);
  std::vector<float> dest(n, -1);
  TensorRequest r = Request(big, 0, {n}, &dest);
  dest.assign(n, -1);
  r.dest = dest.data();
  ASSERT_TRUE(Read({r}).ok());
  EXPECT_EQ(dest[0], 0);
  EXPECT_EQ(dest[n - 1], static_cast<float>(n - 1));
  big[big.size() / 2] ^= 1;  // inside the storage
  Write(big);
  EXPECT_EQ(Read({r}).code(), StatusCode::kDataLoss);
}

Status PutFile(Storage* s, const std::string& key, const std::string& bytes) {
  CAIRN_ASSIGN_OR_RETURN(auto f, s->NewWritableFile(key));
  CAIRN_RETURN_IF_ERROR(f->WriteAt(0, bytes.data(), bytes.size()));
  return f->Close();
}

TEST(StockMetadataTest, AStockCheckpointHasAPickledMetadataFile) {
  auto st = NewMemStorage();
  EXPECT_FALSE(IsStockCheckpoint(st.get()));
  ASSERT_TRUE(PutFile(st.get(), ".metadata", "not a pickle").ok());
  EXPECT_FALSE(IsStockCheckpoint(st.get()));
  ASSERT_TRUE(PutFile(st.get(), "__0.metadata", "\x80\x04rest").ok());  // rank-local
  EXPECT_TRUE(IsStockCheckpoint(st.get()));
}

TEST(StockMetadataTest, MetadataFileIsReadWholeOrRefusedWhenMissingOrTooLarge) {
  auto st = NewMemStorage();
  auto missing = ReadMetadataFile(st.get(), ".metadata", 100);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no DCP metadata file"), std::string::npos);
  ASSERT_TRUE(PutFile(st.get(), ".metadata", std::string(64, 'x')).ok());
  EXPECT_EQ(ReadMetadataFile(st.get(), ".metadata", 100).value(), std::string(64, 'x'));
  auto big = ReadMetadataFile(st.get(), ".metadata", 63);
  EXPECT_EQ(big.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(big.status().message().find("larger than 63 bytes"), std::string::npos);
}

}  // namespace
}  // namespace cairn::stock
