// CRC-32C (Castagnoli; iSCSI, RFC 3720), the checksum S3 verifies as
// x-amz-checksum-crc32c (internal).
//
// Crc32c() uses the SSE4.2 crc32 instruction where the CPU has it (checked
// once, at run time), three independent streams interleaved so that the
// instruction's 3-cycle latency is hidden, their CRCs joined with a
// precomputed "append N zero bytes" operator; elsewhere a portable
// slicing-by-8 table. Both give the same values (tests/cpp/crc32c_test.cc).
//
//   crc32c("123456789") == 0xE3069283
//   Crc32c(b, n2, Crc32c(a, n1)) == crc32c of a then b (chaining)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cairn::internal {

// The CRC-32C of [data, data+n), continuing from `crc` (the CRC of the bytes
// before; 0 to start).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// The two implementations behind Crc32c, for tests and the benchmark.
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);
// Only where Crc32cHardwareAvailable().
uint32_t Crc32cHardware(const void* data, size_t n, uint32_t crc = 0);
bool Crc32cHardwareAvailable();

// Base64 of the CRC's 4 bytes in big-endian order: the value of an
// x-amz-checksum-crc32c header or a <ChecksumCRC32C> element.
std::string Crc32cBase64(uint32_t crc);

}  // namespace cairn::internal
