// AWS Signature Version 4 for S3, signed with OpenSSL (internal).
//
// curl is only the transport: every request is canonicalized and signed here,
// as TensorStore's s3_request_builder does, because the curl of Debian 12
// (7.88) leaves the path and query of CURLOPT_AWS_SIGV4 uncanonicalized and
// does not handle session tokens.
//
//   canonical request = METHOD \n URI \n QUERY \n HEADERS \n SIGNED \n PAYLOAD-HASH
//   string to sign    = "AWS4-HMAC-SHA256" \n DATE \n SCOPE \n hex(sha256(canonical))
//   signing key       = HMAC chain "AWS4"+secret -> date -> region -> service -> "aws4_request"
//                     (service "s3", or "sts" for the credential chain's AssumeRole)
//
// Secrets only ever enter the HMAC chain; nothing here formats them into a
// string that could reach a log or an error message.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cairn::s3 {

// Credentials as AWS tools find them. Never printed.
struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty unless temporary credentials
};

// Lower-case hex SHA-256 of [data, data+n).
std::string Sha256Hex(const void* data, size_t n);
// Base64 of the MD5 of [data, data+n) (the Content-MD5 header).
std::string Md5Base64(const void* data, size_t n);

// RFC 3986 percent-encoding as SigV4 wants it: unreserved characters
// (A-Z a-z 0-9 - . _ ~) stay, everything else becomes %XX; '/' stays unless
// `encode_slash`.
std::string UriEncode(std::string_view s, bool encode_slash);

// "a=1&b=2": the query parameters percent-encoded and sorted by name (then
// value). Used both for the URL and for the canonical request, so the two
// can never disagree.
std::string CanonicalQuery(std::vector<std::pair<std::string, std::string>> query);

// The SHA-256 of an empty payload.
inline constexpr std::string_view kEmptySha256 =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
inline constexpr std::string_view kUnsignedPayload = "UNSIGNED-PAYLOAD";

struct SignRequest {
  std::string method;         // "GET"
  std::string canonical_uri;  // the encoded path, e.g. "/bucket/a/b.bin"
  std::string canonical_query;
  // Headers to sign, names in any case; "host", "x-amz-date" and
  // "x-amz-content-sha256" must be among them.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string payload_hash;  // hex SHA-256 or kUnsignedPayload
  std::string amz_date;      // "20240101T000000Z"
  std::string region;
  std::string service = "s3";  // the scope's service: "s3", "sts"
};

// The value of the Authorization header for `req`.
std::string Authorization(const Credentials& creds, const SignRequest& req);

// The canonical request (exposed for tests).
std::string CanonicalRequest(const SignRequest& req, std::string* signed_headers);

// "YYYYMMDDTHHMMSSZ" for now.
std::string AmzDateNow();

}  // namespace cairn::s3
