// The s3 storage backend: a Storage over an S3 bucket prefix
// ("s3://BUCKET/PREFIX"), for AWS S3 and any S3-compatible store (MinIO,
// moto, Ceph RGW, ...).
//
// Configuration comes from the environment and the AWS config files, as
// with the AWS tools (docs/storage.md has the whole story):
//   credentials  the AWS provider chain: environment, web identity (IRSA),
//                the profile (static keys, role_arn, credential_process),
//                container (ECS, EKS Pod Identity), EC2 instance metadata;
//                temporary credentials are refreshed before they expire
//   region       AWS_REGION, AWS_DEFAULT_REGION, the profile's region,
//                else us-east-1
//   endpoint     AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's
//                services s3 endpoint_url or endpoint_url; with one,
//                requests use path-style addressing (ENDPOINT/BUCKET/KEY)
//                unless s3.addressing_style = virtual; otherwise
//                https://BUCKET.s3.REGION.amazonaws.com/KEY
//   TLS          AWS_CA_BUNDLE or the profile's ca_bundle
// and cairn's own tuning knobs (CAIRN_S3_*, see S3Options).
// Credentials never appear in Describe(), in error messages or in logs.
//
// How the Storage contract maps onto objects:
//   * a file is an object PREFIX/KEY; a directory exists while some object
//     lies below it, or it has a marker object "PREFIX/DIR/" (CreateDir);
//   * a WritableFile buffers its bytes in parts of `part_size`; a small file
//     becomes one PUT at Sync()/Close(), a larger one a multipart upload whose
//     full parts go up as soon as every byte of them was written (or declared
//     a hole), several at once; Sync() or Close() completes it and only then
//     the object appears. Abort() (or an error) aborts the upload.
//     Contract relied on: every byte is written at most once, and bytes of a
//     part already sent are not written again (the checkpoint writer and
//     CopyCheckpoint write each block once). Memory: the parts being filled,
//     about (writer threads x block size) when blocks are written in
//     roughly ascending order, as the checkpoint writer does;
//   * a ReadableFile reads the first `prefetch_bytes` when it is opened
//     (small files, e.g. manifests, are then read whole with one GET) and
//     the rest with ranged GETs straight into the caller's buffer, pinned
//     to the object's ETag: an object replaced after open reads as an error,
//     never as a mix of two versions;
//   * PutAtomic is one PUT (with If-None-Match: * when if_absent);
//   * Rename is copy + delete: NOT atomic for other observers (the commit
//     protocol never relies on Rename for S3, it uses PutAtomic);
//   * SyncDir is a no-op (a completed PUT is durable).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "cairn/status.h"
#include "cairn/storage.h"

namespace cairn {

struct S3Options {
  std::string endpoint;  // "" = AWS (virtual-hosted); else e.g. "http://127.0.0.1:9000"
  std::string region = "us-east-1";
  // "auto": virtual-hosted (https://BUCKET.s3.REGION.amazonaws.com) on AWS
  // when the bucket name allows it, else path style; "path"; "virtual"
  // (also for a custom endpoint: scheme://BUCKET.HOST). The profile's
  // s3.addressing_style.
  std::string addressing_style = "auto";
  // PEM file (or hashed directory) of the CAs trusted for https; "" = the
  // system's. AWS_CA_BUNDLE, else the profile's ca_bundle. TLS peer and host
  // verification are always on.
  std::string ca_bundle;
  // Part size of multipart uploads (>= 5 MiB, S3's minimum) and the size of
  // each ranged GET when a large read is split. CAIRN_S3_PART_SIZE.
  uint64_t part_size = uint64_t{8} << 20;
  // Requests in flight at once per storage (part uploads, split reads).
  // CAIRN_S3_CONCURRENCY.
  int concurrency = 16;
  // Bytes fetched when a file is opened. CAIRN_S3_PREFETCH.
  uint64_t prefetch_bytes = uint64_t{1} << 20;
  // Retries: at most `max_attempts` tries of one request within
  // `retry_deadline_s` seconds in total, with full-jitter exponential backoff
  // from `initial_backoff_s` up to `max_backoff_s`. CAIRN_S3_MAX_ATTEMPTS,
  // CAIRN_S3_RETRY_DEADLINE_S.
  int max_attempts = 10;
  double retry_deadline_s = 110;
  double initial_backoff_s = 0.05;
  double max_backoff_s = 5;
  // Per-attempt limits: connecting, and no byte moving in either direction
  // (a stalled server). CAIRN_S3_CONNECT_TIMEOUT_S, CAIRN_S3_STALL_TIMEOUT_S.
  double connect_timeout_s = 10;
  double stall_timeout_s = 30;
  // Sign the SHA-256 of large bodies too (else "UNSIGNED-PAYLOAD" above
  // 64 KiB; every body is still covered by cairn's own checksums).
  // CAIRN_S3_SIGN_PAYLOAD=1.
  bool sign_payload = false;
  // What a server's answers may make cairn do (see docs/storage.md, "What
  // cairn does not trust in a server's answer"): a whole operation (a
  // listing, a split read, one file's upload from open to completion) ends
  // with kDeadlineExceeded after `operation_deadline_s`
  // (CAIRN_S3_OPERATION_DEADLINE_S), a listing after `max_list_pages` pages
  // (CAIRN_S3_MAX_LIST_PAGES).
  double operation_deadline_s = 3600;
  int max_list_pages = 100000;
  // The checksum every PutObject and UploadPart body carries, which the
  // server verifies (a body changed on the way is refused with BadDigest,
  // and cairn sends it again): "crc32c" (x-amz-checksum-crc32c, a hardware
  // CRC; multipart uploads are created with x-amz-checksum-algorithm CRC32C
  // and completed with each part's ChecksumCRC32C), "md5" (Content-MD5,
  // ~15x the CPU), "off". With "crc32c", a store that refuses the header as
  // unsupported, or answers without echoing it (so may not check it), gets
  // Content-MD5 instead, from then on in this process (logged once; see
  // docs/storage.md). CAIRN_S3_CHECKSUM.
  std::string checksum = "crc32c";
};

// S3Options filled from the environment (see the top of this file).
S3Options S3OptionsFromEnvironment();

// Opens "s3://BUCKET/PREFIX" with `opts` and credentials from the
// environment. Checks the bucket is reachable with one list request; with
// `create` false, a prefix holding nothing is kNotFound.
Result<std::unique_ptr<Storage>> NewS3Storage(std::string_view uri, const S3Options& opts,
                                              bool create = true);

}  // namespace cairn
