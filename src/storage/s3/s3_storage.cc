// S3Storage: the Storage interface over an S3 bucket prefix (see
// include/cairn/s3.h for the mapping of files and directories to objects).
//
// Request path, one place for each concern:
//   Execute()    signs (sigv4.h), sends (http.h) and retries one request:
//                full-jitter exponential backoff on every kUnavailable outcome
//                (5xx, 503 SlowDown, 429, timeouts, stalls, resets, refused
//                connections), bounded by S3Options::max_attempts and by
//                retry_deadline_s in total (each attempt's curl timeout is the
//                time left), so a dead or stalled server gives a clear error
//                in bounded time, never a hang.
//   S3Status()   the one function translating HTTP statuses, S3 error codes
//                and curl failures into Status codes.
//
// Multipart upload protocol of S3WritableFile (why it looks like this: the
// checkpoint writer writes 2 MiB pieces of every block from a thread pool,
// in roughly ascending order but not in order, and never writes the padding
// between items, which it declares with Hole()):
//   1. Bytes are copied into part buffers of part_size (zero-filled, so a
//      hole reads as zeros). Each part counts the bytes written into it.
//   2. The thread whose write completes a full part uploads it (the first one
//      also creates the multipart upload): uploads overlap with the writing
//      of later parts, as many in flight as there are writer threads.
//   3. Sync()/Close() send what is left (the last, partial part and any part
//      with bytes never written) in parallel on the storage's pool, then
//      CompleteMultipartUpload: only now does the object exist. A file that
//      never filled one part and fits in one is a single PUT instead.
//   4. Any failure, Abort() or destruction without Close() aborts the
//      upload, so a failed save leaves no object and no stored parts; parts
//      of a killed process are removed by AbortStaleUploads (cairn prune).
#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <optional>
#include <pugixml.hpp>
#include <random>
#include <set>
#include <thread>
#include <unordered_set>

#include "cairn/s3.h"
#include "cairn/thread_pool.h"
#include "io/crc32c.h"
#include "io/xxh3.h"
#include "storage/s3/aws_config.h"
#include "storage/s3/credentials.h"
#include "storage/s3/http.h"
#include "storage/s3/sigv4.h"

namespace cairn {
namespace {

using s3::HttpRequest;
using s3::HttpResponse;
using Clock = std::chrono::steady_clock;
using Params = std::vector<std::pair<std::string, std::string>>;

constexpr uint64_t kMinPartSize = uint64_t{5} << 20;
constexpr uint64_t kMaxParts = 10000;
constexpr size_t kSignedBodyLimit = 64 << 10;
constexpr uint64_t kMaxCopySize = uint64_t{5} << 30;
// A ListObjectsV2 page holds up to 1000 keys of up to 1024 bytes each, XML
// escaped (up to 6x), plus per-entry overhead: a few MiB at most.
constexpr size_t kMaxListBody = size_t{16} << 20;
// Other XML bodies (errors, upload ids, results) are small.
constexpr size_t kMaxXmlBody = size_t{1} << 20;
constexpr size_t kMaxTokenBytes = 4096;  // a continuation token or marker
constexpr size_t kQuoteLimit = 200;      // server text quoted in an error

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// ---- errors ------------------------------------------------------------------

// Text from a server (a key, an error message) as it may appear in an error
// of ours: printable ASCII kept, other bytes as \xNN (so the message stays
// valid UTF-8 whatever the server sent), cut to `limit` characters.
std::string Quote(std::string_view s, size_t limit = kQuoteLimit) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (out.size() >= limit) {
      out += "... (" + std::to_string(s.size()) + " bytes)";
      break;
    }
    auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

struct S3Error {
  std::string code, message;
};

// Parses an S3 <Error><Code/><Message/></Error> body, if it is one.
// *unparsable: the body mentions <Error but is not XML (e.g. truncated).
std::optional<S3Error> ParseError(const std::string& body, bool* unparsable) {
  *unparsable = false;
  if (body.find("<Error") == std::string::npos) return std::nullopt;
  pugi::xml_document doc;
  if (!doc.load_buffer(body.data(), body.size())) {
    *unparsable = true;
    return std::nullopt;
  }
  pugi::xml_node e = doc.child("Error");
  if (!e) return std::nullopt;
  return S3Error{e.child_value("Code"), e.child_value("Message")};
}

// The one place where the outcome of an S3 request becomes a Status.
Status S3Status(const HttpResponse& r, const std::string& what) {
  if (r.curl_code != 0) {
    if (r.dest_overflow) return UnavailableError(what + ": response longer than requested");
    if (r.tls_unverified) {  // retrying cannot help
      return FailedPreconditionError(what + ": TLS certificate not trusted (" + r.curl_error +
                                     "; AWS_CA_BUNDLE names the CA of a private endpoint)");
    }
    if (r.body_overflow) {
      return UnavailableError(what + ": response body over " + std::to_string(r.body.size()) +
                              " bytes (refused)");
    }
    if (r.header_overflow) return UnavailableError(what + ": response headers too long (refused)");
    return UnavailableError(what + ": " + (r.timed_out ? "timed out" : "request failed") + " (" +
                            Quote(r.curl_error) + ")");
  }
  bool unparsable = false;
  std::optional<S3Error> err = ParseError(r.body, &unparsable);
  if (r.status >= 200 && r.status < 300) {
    // CompleteMultipartUpload and CopyObject can fail with a 200 and an
    // error body; one cut short (a closed connection ends the body) is no
    // success either: retry it.
    if (unparsable) {
      return UnavailableError(what + ": HTTP " + std::to_string(r.status) +
                              " with an unparsable error body (truncated?)");
    }
    if (!err) return Status::OK();
  }
  std::string detail = what + ": HTTP " + std::to_string(r.status);
  if (err && !err->code.empty()) detail += " " + Quote(err->code, 64);
  if (err && !err->message.empty()) detail += ": " + Quote(err->message);
  const std::string code = err ? err->code : std::string();
  // BadDigest / XAmzContentSHA256Mismatch / IncompleteBody: the body was
  // damaged or cut on its way (the server checked Content-MD5 or the length):
  // the same request, sent again, can succeed.
  if (code == "SlowDown" || code == "InternalError" || code == "RequestTimeout" ||
      code == "ServiceUnavailable" || code == "ConditionalRequestConflict" || code == "BadDigest" ||
      code == "XAmzContentSHA256Mismatch" || code == "IncompleteBody") {
    return UnavailableError(detail);
  }
  switch (r.status) {
    case 200:
      return IOError(detail);
    case 400:
      return InvalidArgumentError(detail);
    case 401:
    case 403:
      return PermissionDeniedError(detail);
    case 404:
      return NotFoundError(detail);
    case 409:
      return FailedPreconditionError(detail);
    case 412:
      return AlreadyExistsError(detail);
    case 416:
      return OutOfRangeError(detail);
    case 408:
    case 429:
      return UnavailableError(detail);
    default:
      if (r.status >= 500) return UnavailableError(detail);
      return IOError(detail);
  }
}

std::string XmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// ---- upload checksums ------------------------------------------------------------

// What a request body carries for the server to verify (S3Options::checksum).
enum class BodyChecksum { kOff, kMd5, kCrc32c };

bool ContainsNoCase(std::string_view haystack, std::string_view needle) {
  return std::search(haystack.begin(), haystack.end(), needle.begin(), needle.end(),
                     [](char a, char b) {
                       return std::tolower(static_cast<unsigned char>(a)) ==
                              std::tolower(static_cast<unsigned char>(b));
                     }) != haystack.end();
}

// Whether `r` refuses a request's x-amz-checksum-crc32c (or
// x-amz-checksum-algorithm) header as unsupported, as S3-compatible stores
// without flexible checksums answer: 400 InvalidArgument "Unsupported header
// 'x-amz-checksum-crc32c' received for this API call", NotImplemented
// "Header 'x-amz-checksum-crc32c' ... not implemented", 400 InvalidRequest
// "... checksum ... not supported". Not a checksum that did not match
// (BadDigest: the body was damaged, retried as it is) nor any other refusal.
bool RefusesChecksum(const HttpResponse& r) {
  if (r.curl_code != 0 || (r.status != 400 && r.status != 501)) return false;
  bool unparsable = false;
  std::optional<S3Error> err = ParseError(r.body, &unparsable);
  if (!err) return false;
  if (err->code == "NotImplemented") return true;
  if (err->code != "InvalidArgument" && err->code != "InvalidRequest") return false;
  return ContainsNoCase(err->message, "checksum") &&
         (ContainsNoCase(err->message, "support") || ContainsNoCase(err->message, "implement"));
}

// Endpoints (base URL and bucket) found in this process to lack
// x-amz-checksum-crc32c: storages opened on them later start with
// Content-MD5 (bounded: past kMax, each storage finds out again).
class CrcUnsupported {
 public:
  static bool Known(const std::string& where) {
    std::lock_guard<std::mutex> l(mu());
    return set().count(where) > 0;
  }
  // True the first time `where` is added (the one time it is logged).
  static bool Add(const std::string& where) {
    std::lock_guard<std::mutex> l(mu());
    if (set().count(where)) return false;
    if (set().size() < kMax) set().insert(where);
    return true;
  }

 private:
  static constexpr size_t kMax = 256;
  static std::mutex& mu() {
    static auto* m = new std::mutex;  // never destroyed: storages may outlive statics
    return *m;
  }
  static std::set<std::string>& set() {
    static auto* s = new std::set<std::string>;
    return *s;
  }
};

// ---- the storage ---------------------------------------------------------------

struct Call {
  Call(std::string m, std::string k) : method(std::move(m)), key(std::move(k)) {}
  std::string method;
  std::string key;  // full object key; "" = the bucket
  Params query;
  Params headers;  // lower-case names; signed
  const char* body = nullptr;
  size_t body_len = 0;
  char* dest = nullptr;
  size_t dest_len = 0;
  const std::vector<std::pair<char*, size_t>>* scatter = nullptr;
  // The checksum header the body carries (PutObject, UploadPart: what the
  // storage or the upload chose); unset, for XML bodies: Content-MD5 unless
  // S3Options::checksum is "off". A content-md5 among `headers` wins.
  std::optional<BodyChecksum> checksum;
  std::optional<uint32_t> crc32c;  // the body's CRC-32C, when the caller has it
  // When set, a 2xx answer counts only if its body is an XML document whose
  // root is `expect_root` (parsed into *doc); anything else is retried.
  const char* expect_root = nullptr;
  pugi::xml_document* doc = nullptr;
  size_t max_body = kMaxXmlBody;  // see HttpRequest::max_body
  bool fresh_connection = false;  // see HttpRequest::fresh_connection
  // The deadline of the whole operation this request is part of (a listing,
  // a split read, a file's upload); the retries of this one request stop
  // there too.
  Clock::time_point deadline = Clock::time_point::max();
};

struct Outcome {
  HttpResponse resp;
  Status status;     // S3Status of the last attempt (with the retry count on failure)
  int attempts = 0;  // requests sent (more than 1: an earlier one may have taken effect)
  // The server refused x-amz-checksum-crc32c / -algorithm as unsupported:
  // the request was sent again with Content-MD5 and without them.
  bool checksum_refused = false;
};

struct ObjectInfo {
  uint64_t size = 0;
  std::string etag;
};

struct ListPage {
  std::vector<std::pair<std::string, uint64_t>> objects;  // full key, size
  std::vector<std::string> prefixes;                      // full prefixes ("a/b/")
  bool truncated = false;
  std::string next_token;
};

class S3Storage final : public Storage {
 public:
  // `addr` from s3::ResolveS3Address; `creds` is asked before every attempt.
  S3Storage(S3Options opts, std::shared_ptr<s3::CredentialSource> creds, s3::S3Address addr,
            std::string bucket, std::string prefix)
      : opts_(std::move(opts)),
        creds_(std::move(creds)),
        bucket_(std::move(bucket)),
        prefix_(std::move(prefix)),
        base_url_(std::move(addr.base_url)),
        host_(std::move(addr.host)),
        base_path_(std::move(addr.base_path)),
        path_style_(addr.path_style),
        http_(s3::HttpOptions{opts_.ca_bundle}),
        pool_(static_cast<size_t>(std::max(1, opts_.concurrency))),
        checksum_where_(base_url_ + " bucket " + bucket_) {
    BodyChecksum sum = opts_.checksum == "off"   ? BodyChecksum::kOff
                       : opts_.checksum == "md5" ? BodyChecksum::kMd5
                                                 : BodyChecksum::kCrc32c;
    if (sum == BodyChecksum::kCrc32c && CrcUnsupported::Known(checksum_where_)) {
      sum = BodyChecksum::kMd5;
    }
    checksum_.store(sum);
  }

  // The checksum new PutObject bodies and new uploads' parts carry.
  BodyChecksum checksum() const { return checksum_.load(std::memory_order_relaxed); }

  // The server lacks x-amz-checksum-crc32c (`why`): Content-MD5 from now on,
  // for this storage and the storages opened on it later in this process.
  void FallBackToMd5(const std::string& why) {
    BodyChecksum want = BodyChecksum::kCrc32c;
    if (!checksum_.compare_exchange_strong(want, BodyChecksum::kMd5)) return;
    if (CrcUnsupported::Add(checksum_where_)) {
      std::fprintf(stderr,
                   "cairn: S3 endpoint %s: %s; uploads there carry Content-MD5 instead from now "
                   "on (CAIRN_S3_CHECKSUM=md5 chooses it from the start)\n",
                   checksum_where_.c_str(), why.c_str());
    }
  }

  // ---- requests ----

  // Executes `c`; its body must be an XML document whose root is `root` (kept
  // in *doc, which owns the returned node). A body that is not is retried.
  Result<pugi::xml_node> ExecuteXml(Call c, const std::string& what, const char* root,
                                    pugi::xml_document* doc) {
    c.expect_root = root;
    c.doc = doc;
    Outcome o = Execute(c, what);
    CAIRN_RETURN_IF_ERROR(o.status);
    return doc->child(root);
  }

  // The deadline of an operation starting now (S3Options::operation_deadline_s).
  Clock::time_point OperationDeadline() const {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(opts_.operation_deadline_s));
  }

  Outcome Execute(const Call& c, const std::string& what) {
    std::string payload_hash =
        c.body_len <= kSignedBodyLimit || opts_.sign_payload
            ? (c.body_len ? s3::Sha256Hex(c.body, c.body_len) : std::string(s3::kEmptySha256))
            : std::string(s3::kUnsignedPayload);
    std::string uri = base_path_;
    if (path_style_) uri += "/" + s3::UriEncode(bucket_, true);
    if (!c.key.empty() || !path_style_) uri += "/" + s3::UriEncode(c.key, false);
    std::string query = s3::CanonicalQuery(c.query);
    std::string url = base_url_ + uri + (query.empty() ? "" : "?" + query);
    // Every body sent carries a checksum the server verifies (BadDigest,
    // retried): a byte changed on the way is refused, not stored. Computed
    // here, on the calling thread: parts are sent from many threads at once.
    auto has = [&](std::string_view name) {
      return std::any_of(c.headers.begin(), c.headers.end(),
                         [&](const auto& h) { return h.first == name; });
    };
    BodyChecksum sum = BodyChecksum::kOff;
    if (c.body_len > 0 && !has("content-md5")) {
      sum = c.checksum
                ? *c.checksum
                : (checksum() == BodyChecksum::kOff ? BodyChecksum::kOff : BodyChecksum::kMd5);
    }
    bool algorithm_header = has("x-amz-checksum-algorithm");
    std::string sum_name, sum_value;
    auto choose = [&](BodyChecksum k) {
      sum = k;
      sum_name.clear();
      sum_value.clear();
      if (k == BodyChecksum::kCrc32c) {
        sum_name = "x-amz-checksum-crc32c";
        sum_value =
            internal::Crc32cBase64(c.crc32c ? *c.crc32c : internal::Crc32c(c.body, c.body_len));
      } else if (k == BodyChecksum::kMd5) {
        sum_name = "content-md5";
        sum_value = s3::Md5Base64(c.body, c.body_len);
      }
    };
    choose(sum);

    const Clock::time_point start = Clock::now();
    const auto retry_deadline = start + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(opts_.retry_deadline_s));
    const bool operation_bound = c.deadline < retry_deadline;
    const auto deadline = std::min(retry_deadline, c.deadline);
    thread_local std::mt19937_64 rng{std::random_device{}()};
    Outcome out;
    auto past_operation_deadline = [&](int attempts) {
      char buf[160];
      std::snprintf(buf, sizeof buf,
                    ": the operation's deadline (%.0f s, CAIRN_S3_OPERATION_DEADLINE_S) passed "
                    "after %d attempt%s of this request",
                    opts_.operation_deadline_s, attempts, attempts == 1 ? "" : "s");
      std::string last = out.status.ok() ? "" : " (last: " + out.status.message() + ")";
      out.status = DeadlineExceededError(what + buf + last);
      return out;
    };
    if (Clock::now() >= deadline) return past_operation_deadline(0);
    for (int attempt = 1;; ++attempt) {
      HttpRequest req;
      req.method = c.method;
      req.url = url;
      req.body = c.body;
      req.body_len = c.body_len;
      req.dest = c.dest;
      req.dest_len = c.dest_len;
      req.scatter = c.scatter;
      req.max_body = c.max_body;
      req.fresh_connection = c.fresh_connection;
      Params hs;
      for (const auto& h : c.headers) {
        if (algorithm_header || h.first != "x-amz-checksum-algorithm") hs.push_back(h);
      }
      if (!sum_value.empty()) hs.emplace_back(sum_name, sum_value);
      const std::string date = s3::AmzDateNow();
      hs.emplace_back("host", host_);
      hs.emplace_back("x-amz-date", date);
      hs.emplace_back("x-amz-content-sha256", payload_hash);
      // Asked per attempt: a retry after a refresh signs with the new keys.
      Result<s3::Credentials> creds = creds_->Current();
      if (!creds.ok()) {
        out.status = creds.status().WithContext(what);
        return out;
      }
      if (!creds->session_token.empty()) {
        hs.emplace_back("x-amz-security-token", creds->session_token);
      }
      s3::SignRequest sr{c.method, uri, query, hs, payload_hash, date, opts_.region};
      req.headers = hs;
      req.headers.emplace_back("authorization", s3::Authorization(*creds, sr));
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      req.total_timeout_ms = std::max<long>(1, static_cast<long>(left.count()));
      req.connect_timeout_ms = static_cast<long>(opts_.connect_timeout_s * 1000);
      req.stall_timeout_ms = static_cast<long>(opts_.stall_timeout_s * 1000);
      out.resp = http_.Perform(req);
      out.attempts = attempt;
      out.status = S3Status(out.resp, what);
      if (out.status.ok() && c.expect_root) {
        // A 2xx is a success only with the body this operation returns.
        const std::string& b = out.resp.body;
        if (!c.doc->load_buffer(b.data(), b.size()) || !c.doc->child(c.expect_root)) {
          out.status =
              UnavailableError(what + ": HTTP " + std::to_string(out.resp.status) + " without a " +
                               c.expect_root + " (a malformed or truncated response)");
        }
      }
      if ((sum == BodyChecksum::kCrc32c || algorithm_header) && RefusesChecksum(out.resp)) {
        // A store without flexible checksums: the same request at once,
        // with Content-MD5 instead (not a failure; it did not take effect).
        FallBackToMd5("the server refused x-amz-checksum-crc32c as unsupported (" +
                      out.status.message() + ")");
        out.checksum_refused = true;
        algorithm_header = false;
        if (sum == BodyChecksum::kCrc32c) choose(BodyChecksum::kMd5);
        continue;
      }
      if (out.status.ok() && sum == BodyChecksum::kCrc32c && c.method == "PUT" &&
          out.resp.headers.count("x-amz-checksum-crc32c") == 0) {
        // S3 echoes the checksum it verified; a store that does not may have
        // ignored it (this body went unverified by the server; cairn's own
        // checksums still cover it at load).
        FallBackToMd5(
            "its answer to a PUT with x-amz-checksum-crc32c did not echo it (a store "
            "that ignores the header does not check it)");
      }
      if (out.status.code() != StatusCode::kUnavailable) return out;
      double cap =
          std::min(opts_.max_backoff_s,
                   opts_.initial_backoff_s * static_cast<double>(1ull << std::min(attempt, 30)));
      double sleep_s = std::uniform_real_distribution<double>(0, cap)(rng);
      auto wake = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(sleep_s));
      if (operation_bound && attempt < opts_.max_attempts && wake >= deadline) {
        return past_operation_deadline(attempt);
      }
      if (attempt >= opts_.max_attempts || wake >= deadline) {
        double spent = std::chrono::duration<double>(Clock::now() - start).count();
        char buf[96];
        std::snprintf(buf, sizeof buf, " (gave up after %d attempt%s in %.1f s)", attempt,
                      attempt == 1 ? "" : "s", spent);
        out.status = Status(out.status.code(), out.status.message() + buf);
        return out;
      }
      std::this_thread::sleep_until(wake);
    }
  }

  std::string Full(std::string_view key) const {
    if (prefix_.empty()) return std::string(key);
    if (key.empty()) return prefix_;
    return prefix_ + "/" + std::string(key);
  }
  // The listing prefix of directory `dir` ("" = the root).
  std::string DirPrefix(std::string_view dir) const {
    std::string f = Full(dir);
    return f.empty() ? f : f + "/";
  }
  std::string Uri(std::string_view key) const {
    std::string s = "s3://" + bucket_;
    std::string f = Full(key);
    return f.empty() ? s : s + "/" + f;
  }

  Result<std::optional<ObjectInfo>> Head(const std::string& full) {
    Call c("HEAD", full);
    Outcome o = Execute(c, "looking up " + FullUri(full));
    if (o.resp.status == 404) return std::optional<ObjectInfo>();
    if (!o.status.ok()) return o.status;
    ObjectInfo info;
    info.size = std::strtoull(o.resp.headers["content-length"].c_str(), nullptr, 10);
    info.etag = o.resp.headers["etag"];
    return std::optional<ObjectInfo>(info);
  }

  std::string FullUri(const std::string& full) const { return "s3://" + bucket_ + "/" + full; }

  // One ListObjectsV2 page, as the server sent it (see ListChecked).
  Status List(const std::string& prefix, const std::string& delimiter, const std::string& token,
              int max_keys, Clock::time_point deadline, ListPage* page) {
    Call c("GET", "");
    c.query = {{"list-type", "2"}, {"prefix", prefix}};
    if (!delimiter.empty()) c.query.emplace_back("delimiter", delimiter);
    if (!token.empty()) c.query.emplace_back("continuation-token", token);
    if (max_keys > 0) c.query.emplace_back("max-keys", std::to_string(max_keys));
    c.max_body = kMaxListBody;
    c.deadline = deadline;
    pugi::xml_document doc;
    CAIRN_ASSIGN_OR_RETURN(pugi::xml_node r,
                           ExecuteXml(c, "listing " + FullUri(prefix), "ListBucketResult", &doc));
    for (pugi::xml_node n : r.children("Contents")) {
      page->objects.emplace_back(n.child_value("Key"),
                                 std::strtoull(n.child_value("Size"), nullptr, 10));
    }
    for (pugi::xml_node n : r.children("CommonPrefixes")) {
      page->prefixes.emplace_back(n.child_value("Prefix"));
    }
    page->truncated = std::string_view(r.child_value("IsTruncated")) == "true";
    page->next_token = r.child_value("NextContinuationToken");
    if (page->truncated && page->next_token.empty()) {
      return UnavailableError("listing " + FullUri(prefix) + ": truncated without a token");
    }
    return Status::OK();
  }

  // Whether `entry`, listed below `prefix`, is what such a listing may hold:
  // it starts with `prefix`; with a delimiter, an object has none after the
  // prefix and a common prefix exactly one, at its end. Anything else (a
  // misbehaving server or proxy) is refused, never cut into a name, copied or
  // deleted.
  Status CheckListed(const std::string& prefix, const std::string& delimiter,
                     const std::string& entry, bool common_prefix) const {
    bool ok = entry.size() >= prefix.size() && entry.compare(0, prefix.size(), prefix) == 0;
    if (ok && !delimiter.empty()) {
      std::string_view rest = std::string_view(entry).substr(prefix.size());
      size_t d = rest.find(delimiter);
      ok = common_prefix ? rest.size() > delimiter.size() && d == rest.size() - delimiter.size()
                         : d == std::string_view::npos;
    }
    if (ok) return Status::OK();
    return IOError("listing " + FullUri(prefix) + ": the server returned " +
                   (common_prefix ? "prefix '" : "key '") + Quote(entry) +
                   "', which does not lie below '" + Quote(prefix) +
                   "' (a misbehaving server or proxy; the listing is refused)");
  }

  // Every entry below `prefix` (rolled up at `delimiter` when not empty),
  // page after page, into *out. What a page says is checked, not trusted:
  // every entry lies below the prefix (CheckListed); no entry comes twice; a
  // continuation token that comes back (a server or proxy that loops) or
  // more than S3Options::max_list_pages pages end the listing with an
  // error, and so does the operation deadline. `max_keys` > 0: one page of
  // at most that many.
  Status ListChecked(const std::string& prefix, const std::string& delimiter, int max_keys,
                     ListPage* out) {
    const Clock::time_point deadline = OperationDeadline();
    std::unordered_set<uint64_t> seen, tokens;  // XXH3 of entries and of tokens
    std::string token;
    for (int pages = 1;; ++pages) {
      ListPage page;
      CAIRN_RETURN_IF_ERROR(List(prefix, delimiter, token, max_keys, deadline, &page));
      auto once = [&](const std::string& e) -> Status {
        // Objects and common prefixes cannot clash: only prefixes end in the
        // delimiter.
        if (seen.insert(XXH3_64bits(e.data(), e.size())).second) return Status::OK();
        return IOError("listing " + FullUri(prefix) + ": the server returned '" + Quote(e) +
                       "' twice (a misbehaving server or proxy; the listing is refused)");
      };
      for (auto& [k, size] : page.objects) {
        CAIRN_RETURN_IF_ERROR(CheckListed(prefix, delimiter, k, false));
        CAIRN_RETURN_IF_ERROR(once(k));
        out->objects.emplace_back(std::move(k), size);
      }
      for (auto& p : page.prefixes) {
        CAIRN_RETURN_IF_ERROR(CheckListed(prefix, delimiter, p, true));
        CAIRN_RETURN_IF_ERROR(once(p));
        out->prefixes.push_back(std::move(p));
      }
      if (!page.truncated || max_keys > 0) return Status::OK();
      const std::string& t = page.next_token;
      if (t.size() > kMaxTokenBytes) {
        return IOError("listing " + FullUri(prefix) + ": a continuation token of " +
                       std::to_string(t.size()) + " bytes (a misbehaving server or proxy)");
      }
      if (!tokens.insert(XXH3_64bits(t.data(), t.size())).second) {
        return IOError("listing " + FullUri(prefix) + ": the server repeated continuation token '" +
                       Quote(t, 64) + "' after " + std::to_string(pages) +
                       " pages (a misbehaving server or proxy: the listing would never end)");
      }
      if (pages >= opts_.max_list_pages) {
        return IOError("listing " + FullUri(prefix) + ": more than " +
                       std::to_string(opts_.max_list_pages) +
                       " pages (CAIRN_S3_MAX_LIST_PAGES; a server that never ends its listing?)");
      }
      token = t;
    }
  }

  // Every object below `prefix` (all pages).
  Result<std::vector<std::pair<std::string, uint64_t>>> ListAll(const std::string& prefix) {
    ListPage page;
    CAIRN_RETURN_IF_ERROR(ListChecked(prefix, "", 0, &page));
    return std::move(page.objects);
  }

  // Whether anything (an object or a marker) lies below `prefix`.
  Result<bool> AnyBelow(const std::string& prefix) {
    ListPage page;
    CAIRN_RETURN_IF_ERROR(ListChecked(prefix, "", 1, &page));
    return !page.objects.empty() || !page.prefixes.empty();
  }

  Status PutObject(const std::string& full, const char* data, size_t n, bool if_absent) {
    Call c("PUT", full);
    c.body = data;
    c.body_len = n;
    c.checksum = checksum();
    if (if_absent) c.headers.emplace_back("if-none-match", "*");
    Outcome o = Execute(c, "writing " + FullUri(full));
    if (o.resp.status == 412 && if_absent) {
      // Our own earlier attempt may have been stored and only its answer
      // lost: then the object holds exactly these bytes, and the write
      // succeeded.
      CAIRN_ASSIGN_OR_RETURN(bool ours, Holds(full, data, n));
      if (ours) return Status::OK();
      return AlreadyExistsError(FullUri(full) + " already exists (written by another writer?)");
    }
    return o.status;
  }

  // Whether object `full` holds exactly the n bytes at `data` (reads at most
  // n bytes of it).
  Result<bool> Holds(const std::string& full, const char* data, size_t n) {
    std::string stored(n, '\0');
    Call c("GET", full);
    c.dest = stored.data();
    c.dest_len = n;
    Outcome o = Execute(c, "reading back " + FullUri(full));
    if (o.resp.dest_overflow || o.resp.status == 404) return false;
    CAIRN_RETURN_IF_ERROR(o.status);
    return o.resp.dest_written == n && std::memcmp(stored.data(), data, n) == 0;
  }

  Status DeleteObject(const std::string& full, const std::string& upload_id = {}) {
    Call c("DELETE", full);
    if (!upload_id.empty()) c.query = {{"uploadId", upload_id}};
    Outcome o =
        Execute(c, (upload_id.empty() ? "deleting " : "aborting the upload of ") + FullUri(full));
    if (!upload_id.empty() && o.resp.status == 404) return Status::OK();  // already gone
    return o.status;
  }

  Status DeleteObjects(const std::vector<std::string>& keys) {
    // Keys come from checked listings; still, nothing outside the storage's
    // own prefix is ever deleted.
    const std::string root = DirPrefix("");
    for (const std::string& k : keys) {
      if (k.compare(0, root.size(), root) != 0) {
        return InternalError("refusing to delete " + Quote(FullUri(k)) + ": outside " + Uri(""));
      }
    }
    for (size_t i = 0; i < keys.size(); i += 1000) {
      std::string body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Delete><Quiet>true</Quiet>";
      for (size_t j = i; j < std::min(keys.size(), i + 1000); ++j) {
        body += "<Object><Key>" + XmlEscape(keys[j]) + "</Key></Object>";
      }
      body += "</Delete>";
      Call c("POST", "");
      c.query = {{"delete", ""}};
      c.headers = {{"content-md5", s3::Md5Base64(body.data(), body.size())},
                   {"content-type", "application/xml"}};
      c.body = body.data();
      c.body_len = body.size();
      pugi::xml_document doc;
      CAIRN_ASSIGN_OR_RETURN(pugi::xml_node r, ExecuteXml(c, "deleting objects below " + Uri(""),
                                                          "DeleteResult", &doc));
      if (pugi::xml_node e = r.child("Error")) {
        return IOError("deleting " + Quote(FullUri(e.child_value("Key"))) + ": " +
                       Quote(e.child_value("Code"), 64) + ": " + Quote(e.child_value("Message")));
      }
    }
    return Status::OK();
  }

  Status CopyObject(const std::string& from, const std::string& to, uint64_t size) {
    if (size > kMaxCopySize) {
      return UnimplementedError("renaming " + FullUri(from) +
                                ": objects over 5 GiB cannot be copied");
    }
    Call c("PUT", to);
    c.headers = {{"x-amz-copy-source", "/" + bucket_ + "/" + s3::UriEncode(from, false)}};
    pugi::xml_document doc;  // a 200 can carry an error: only a result is one
    return ExecuteXml(c, "copying " + FullUri(from) + " to " + FullUri(to), "CopyObjectResult",
                      &doc)
        .status();
  }

  // Fails unless `key` may become a file: not a directory, no parent a file.
  Status CheckCreatable(std::string_view key) {
    CAIRN_ASSIGN_OR_RETURN(bool is_dir, AnyBelow(DirPrefix(key)));
    if (is_dir) return FailedPreconditionError(Uri(key) + " is a directory");
    for (size_t slash = key.find('/'); slash != std::string_view::npos;
         slash = key.find('/', slash + 1)) {
      CAIRN_ASSIGN_OR_RETURN(auto parent, Head(Full(key.substr(0, slash))));
      if (parent) {
        return FailedPreconditionError("cannot create " + Uri(key) + ": " +
                                       Uri(key.substr(0, slash)) + " is a file");
      }
    }
    return Status::OK();
  }

  // ---- Storage ----

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions& opts) override;
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions& opts) override;

  Status Rename(std::string_view from, std::string_view to) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(from));
    CAIRN_RETURN_IF_ERROR(ValidateKey(to));
    const std::string src = Full(from), dst = Full(to);
    CAIRN_ASSIGN_OR_RETURN(auto info, Head(src));
    if (info) {
      CAIRN_RETURN_IF_ERROR(CheckCreatable(to));
      CAIRN_RETURN_IF_ERROR(CopyObject(src, dst, info->size));
      return DeleteObject(src);
    }
    const std::string sp = DirPrefix(from), dp = DirPrefix(to);
    CAIRN_ASSIGN_OR_RETURN(auto objects, ListAll(sp));
    if (objects.empty())
      return NotFoundError("renaming " + Uri(from) + ": no such file or directory");
    TaskGroup group(&pool_);
    for (const auto& [k, size] : objects) {
      // ListAll checked that every key starts with sp.
      if (k.compare(0, sp.size(), sp) != 0) return InternalError("listed " + Quote(k));
      std::string target = dp + k.substr(sp.size());
      uint64_t sz = size;
      group.Run([this, k = k, target, sz] { return CopyObject(k, target, sz); });
    }
    CAIRN_RETURN_IF_ERROR(group.Wait());
    std::vector<std::string> keys;
    for (const auto& o : objects) keys.push_back(o.first);
    return DeleteObjects(keys);
  }

  Status SyncDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    if (dir.empty()) return Status::OK();
    CAIRN_ASSIGN_OR_RETURN(bool any, AnyBelow(DirPrefix(dir)));
    return any ? Status::OK() : NotFoundError(Uri(dir) + ": no such directory");
  }

  Status CreateDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    if (dir.empty()) return Status::OK();
    CAIRN_ASSIGN_OR_RETURN(auto file, Head(Full(dir)));
    if (file) return FailedPreconditionError("cannot create directory " + Uri(dir) + ": a file");
    std::string marker = DirPrefix(dir);
    return PutObject(marker, "", 0, false);
  }

  Status DeleteFile(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    CAIRN_ASSIGN_OR_RETURN(auto info, Head(Full(key)));
    if (!info) return NotFoundError("deleting " + Uri(key) + ": no such file");
    return DeleteObject(Full(key));
  }

  Status DeleteDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    CAIRN_ASSIGN_OR_RETURN(auto objects, ListAll(DirPrefix(dir)));
    std::vector<std::string> keys;
    for (const auto& o : objects) keys.push_back(o.first);
    return DeleteObjects(keys).WithContext("deleting " + Uri(dir));
  }

  Result<std::vector<DirEntry>> List(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    const std::string prefix = DirPrefix(dir);
    std::vector<DirEntry> out;
    ListPage page;
    CAIRN_RETURN_IF_ERROR(ListChecked(prefix, "/", 0, &page));
    const bool found = !page.objects.empty() || !page.prefixes.empty();
    // ListChecked checked that every entry starts with `prefix`.
    for (const auto& [k, size] : page.objects) {
      if (k.size() == prefix.size()) continue;  // the directory's own marker
      out.push_back({k.substr(prefix.size()), false, size});
    }
    for (const auto& p : page.prefixes) {
      std::string name = p.substr(prefix.size());
      if (!name.empty() && name.back() == '/') name.pop_back();
      if (!name.empty()) out.push_back({name, true, 0});
    }
    if (!found && !dir.empty()) return NotFoundError(Uri(dir) + ": no such directory");
    std::sort(out.begin(), out.end());
    return out;
  }

  Result<bool> Exists(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key, true));
    if (key.empty()) return true;
    CAIRN_ASSIGN_OR_RETURN(auto info, Head(Full(key)));
    if (info) return true;
    return AnyBelow(DirPrefix(key));
  }

  Result<uint64_t> FileSize(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    CAIRN_ASSIGN_OR_RETURN(auto info, Head(Full(key)));
    if (!info) return NotFoundError(Uri(key) + ": no such file");
    return info->size;
  }

  Status PutAtomic(std::string_view key, std::string_view data, bool if_absent) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    return PutObject(Full(key), data.data(), data.size(), if_absent);
  }

  Status AbortStaleUploads(std::string_view dir, double older_than_s, size_t* aborted) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    if (aborted) *aborted = 0;
    const std::string prefix = DirPrefix(dir);
    const std::time_t cutoff = std::time(nullptr) - static_cast<std::time_t>(older_than_s);
    return ForEachUpload(
        prefix,
        [&](const std::string& key, const std::string& id, std::time_t initiated) -> Status {
          if (initiated > cutoff) return Status::OK();
          CAIRN_RETURN_IF_ERROR(DeleteObject(key, id));
          if (aborted) ++*aborted;
          return Status::OK();
        });
  }

  // Calls fn(key, upload id, initiated) for every multipart upload in
  // progress below `prefix` (upload listings are checked as ListChecked
  // checks object listings: a key outside the prefix, a repeated marker or
  // too many pages is an error, and nothing outside is ever aborted).
  template <typename Fn>
  Status ForEachUpload(const std::string& prefix, Fn fn) {
    const std::string what = "listing uploads below " + FullUri(prefix);
    const Clock::time_point deadline = OperationDeadline();
    std::unordered_set<uint64_t> markers;
    std::string key_marker, id_marker;
    for (int pages = 1;; ++pages) {
      Call c("GET", "");
      c.query = {{"uploads", ""}, {"prefix", prefix}};
      if (!key_marker.empty()) c.query.emplace_back("key-marker", key_marker);
      if (!id_marker.empty()) c.query.emplace_back("upload-id-marker", id_marker);
      c.max_body = kMaxListBody;
      c.deadline = deadline;
      pugi::xml_document doc;
      CAIRN_ASSIGN_OR_RETURN(pugi::xml_node r,
                             ExecuteXml(c, what, "ListMultipartUploadsResult", &doc));
      for (pugi::xml_node u : r.children("Upload")) {
        const std::string key = u.child_value("Key"), id = u.child_value("UploadId");
        CAIRN_RETURN_IF_ERROR(CheckListed(prefix, "", key, false));
        if (id.empty()) return IOError(what + ": an upload of " + Quote(key) + " without an id");
        std::tm tm{};
        const char* initiated = u.child_value("Initiated");
        if (!strptime(initiated, "%Y-%m-%dT%H:%M:%S", &tm)) continue;
        CAIRN_RETURN_IF_ERROR(fn(key, id, timegm(&tm)));
      }
      if (std::string_view(r.child_value("IsTruncated")) != "true") return Status::OK();
      key_marker = r.child_value("NextKeyMarker");
      id_marker = r.child_value("NextUploadIdMarker");
      if (key_marker.empty()) return Status::OK();
      std::string both = key_marker + '\0' + id_marker;
      if (both.size() > 2 * kMaxTokenBytes ||
          !markers.insert(XXH3_64bits(both.data(), both.size())).second) {
        return IOError(what + ": the server repeated (or sent an absurd) marker '" +
                       Quote(key_marker, 64) + "' (a misbehaving server or proxy)");
      }
      if (pages >= opts_.max_list_pages) {
        return IOError(what + ": more than " + std::to_string(opts_.max_list_pages) +
                       " pages (CAIRN_S3_MAX_LIST_PAGES; a server that never ends its listing?)");
      }
    }
  }

  std::string Describe() const override { return Uri(""); }

  const S3Options& options() const { return opts_; }
  ThreadPool* pool() { return &pool_; }

 private:
  const S3Options opts_;
  const std::shared_ptr<s3::CredentialSource> creds_;
  const std::string bucket_, prefix_;
  const std::string base_url_, host_, base_path_;
  const bool path_style_;
  s3::HttpClient http_;
  ThreadPool pool_;
  const std::string checksum_where_;  // the endpoint and bucket, for CrcUnsupported
  std::atomic<BodyChecksum> checksum_{BodyChecksum::kCrc32c};
};

// ---- files -----------------------------------------------------------------------

class S3WritableFile final : public WritableFile {
 public:
  S3WritableFile(S3Storage* s, std::string full, std::string uri)
      : s_(s),
        full_(std::move(full)),
        uri_(std::move(uri)),
        part_size_(s->options().part_size),
        deadline_(s->OperationDeadline()) {}
  ~S3WritableFile() override {
    if (!finished_) AbortUpload();
    for (char* b : spare_) std::free(b);
  }

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    return Fill(offset, static_cast<const char*>(data), n);
  }
  Status Hole(uint64_t offset, uint64_t n) override { return Fill(offset, nullptr, n); }

  Status Allocate(uint64_t size) override {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_ || finished_) return FailedPreconditionError(uri_ + ": file is closed");
    allocated_ = std::max(allocated_, size);
    // Stay within S3's 10000 parts while nothing is buffered yet.
    if (parts_.empty() && size > kMaxParts * part_size_) {
      part_size_ = ((size + kMaxParts - 1) / kMaxParts + (1 << 20) - 1) / (1 << 20) * (1 << 20);
    }
    return Status::OK();
  }

  Status Sync() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (closed_) return FailedPreconditionError(uri_ + ": sync after close");
      if (finished_) return error_;
    }
    return Finish();
  }

  Status Close() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (closed_) return Status::OK();
      closed_ = true;
      if (finished_) return Status::OK();
    }
    return Finish();
  }

  Status Abort() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      closed_ = true;
      if (finished_) return Status::OK();
      finished_ = true;
    }
    AbortUpload();
    return Status::OK();
  }

 private:
  struct Part {
    char* buf = nullptr;  // part_size_ bytes, zero-filled; freed once sent
    uint64_t covered = 0;
    bool sent = false;  // uploading or uploaded: no more writes
    std::string etag;
    uint32_t crc32c = 0;  // of an upload created with CRC32C: its ChecksumCRC32C
    ~Part() { std::free(buf); }
  };

  // A zero-filled part buffer (needs mu_): a sent part's buffer is reused,
  // zeroed again, rather than returned to the system, because a fresh 8 MiB
  // allocation is a new mapping whose page faults and unmapping (with its
  // TLB shootdowns across the writer threads) cost more than the memset.
  char* NewBuffer() {
    if (spare_.empty()) return static_cast<char*>(std::calloc(1, part_size_));
    char* b = spare_.back();
    spare_.pop_back();
    std::memset(b, 0, part_size_);
    return b;
  }

  Status Fail(Status s) {
    std::lock_guard<std::mutex> l(mu_);
    if (error_.ok()) error_ = s;
    return s;
  }

  Status Fill(uint64_t offset, const char* src, uint64_t n) {
    while (n > 0) {
      uint64_t idx, in, len;
      Part* part;
      {
        std::lock_guard<std::mutex> l(mu_);
        if (closed_ || finished_) return FailedPreconditionError(uri_ + ": write after close");
        if (!error_.ok()) return error_;
        idx = offset / part_size_;
        in = offset % part_size_;
        len = std::min(n, part_size_ - in);
        if (idx >= kMaxParts) {
          return ResourceExhaustedError(uri_ + ": larger than 10000 parts of " +
                                        std::to_string(part_size_) + " bytes");
        }
        part = &parts_[idx];
        if (part->sent) {
          return FailedPreconditionError(uri_ + ": write into part " + std::to_string(idx + 1) +
                                         ", already uploaded (bytes written twice?)");
        }
        if (!part->buf) part->buf = NewBuffer();
        if (!part->buf) return ResourceExhaustedError(uri_ + ": cannot allocate a part buffer");
        end_ = std::max(end_, offset + len);
      }
      // Disjoint ranges: copy outside the lock; the count below orders it.
      if (src) std::memcpy(part->buf + in, src, len);
      bool full = false;
      {
        std::lock_guard<std::mutex> l(mu_);
        part->covered += len;
        if (part->covered > part_size_) {
          return Fail(FailedPreconditionError(uri_ + ": bytes of part " + std::to_string(idx + 1) +
                                              " written twice"));
        }
        if (part->covered == part_size_) full = part->sent = true;
      }
      if (full) {
        Status s = SendPart(idx, part, part_size_);
        if (!s.ok()) return Fail(s);
      }
      offset += len;
      if (src) src += len;
      n -= len;
    }
    return Status::OK();
  }

  Status EnsureUpload() {
    std::lock_guard<std::mutex> l(upload_mu_);
    if (!upload_id_.empty()) return Status::OK();
    Call c("POST", full_);
    c.query = {{"uploads", ""}};
    // The upload's checksum is fixed at its creation: with CRC32C, S3 wants
    // it on every part and every part's in CompleteMultipartUpload.
    const BodyChecksum sum = s_->checksum();
    if (sum == BodyChecksum::kCrc32c) c.headers = {{"x-amz-checksum-algorithm", "CRC32C"}};
    c.deadline = deadline_;
    c.expect_root = "InitiateMultipartUploadResult";
    // Every create is one attempt of ours (curl would resend it unseen on a
    // dead reused connection), so that attempts > 1 tells of orphans.
    c.fresh_connection = true;
    pugi::xml_document doc;
    c.doc = &doc;
    Outcome o = s_->Execute(c, "starting the upload of " + uri_);
    CAIRN_RETURN_IF_ERROR(o.status);
    upload_id_ = doc.child("InitiateMultipartUploadResult").child_value("UploadId");
    if (upload_id_.empty())
      return UnavailableError("starting the upload of " + uri_ + ": no UploadId");
    // Refused as unsupported: created again without the algorithm.
    upload_checksum_ = o.checksum_refused ? BodyChecksum::kMd5 : sum;
    if (o.attempts > 1) AbortOrphans();
    return Status::OK();
  }

  // A retried create may have created uploads whose answers were lost:
  // abort every other upload in progress of this very key. Besides such
  // orphans there can only be a killed writer's leftovers or a second writer
  // of the same object at the same time, which could not both be kept
  // anyway (its completion would replace this one's object). Not filtered
  // by time: servers' Initiated times are not reliable (moto reports a
  // fixed date). Best effort: what is left, AbortStaleUploads (cairn prune)
  // removes.
  void AbortOrphans() {
    s_->ForEachUpload(full_,
                      [&](const std::string& key, const std::string& id, std::time_t) -> Status {
                        if (key != full_ || id == upload_id_) return Status::OK();
                        return s_->DeleteObject(key, id);
                      })
        .IgnoreError();
  }

  std::string UploadId() {
    std::lock_guard<std::mutex> l(upload_mu_);
    return upload_id_;
  }
  BodyChecksum UploadChecksum() {
    std::lock_guard<std::mutex> l(upload_mu_);
    return upload_checksum_;
  }

  Status SendPart(uint64_t idx, Part* part, uint64_t len) {
    CAIRN_RETURN_IF_ERROR(EnsureUpload());
    Call c("PUT", full_);
    c.query = {{"partNumber", std::to_string(idx + 1)}, {"uploadId", UploadId()}};
    c.body = part->buf;
    c.body_len = len;
    c.deadline = deadline_;
    c.checksum = UploadChecksum();
    uint32_t crc = 0;
    if (*c.checksum == BodyChecksum::kCrc32c) {
      // Kept for CompleteMultipartUpload; a store that refused the header
      // for an earlier part gets Content-MD5 for the rest.
      crc = internal::Crc32c(part->buf, len);
      c.crc32c = crc;
      if (parts_refuse_crc_.load(std::memory_order_relaxed)) c.checksum = BodyChecksum::kMd5;
    }
    Outcome o = s_->Execute(c, "uploading part " + std::to_string(idx + 1) + " of " + uri_);
    if (o.checksum_refused) parts_refuse_crc_.store(true, std::memory_order_relaxed);
    CAIRN_RETURN_IF_ERROR(o.status);
    std::string etag = o.resp.headers["etag"];
    if (etag.empty()) return UnavailableError("uploading part of " + uri_ + ": no ETag");
    std::lock_guard<std::mutex> l(mu_);
    part->etag = std::move(etag);
    part->crc32c = crc;
    if (spare_.size() < kSpareBuffers) {
      spare_.push_back(part->buf);
    } else {
      std::free(part->buf);
    }
    part->buf = nullptr;
    return Status::OK();
  }

  static std::string Unquote(std::string_view e) {
    if (e.size() >= 2 && e.front() == '"' && e.back() == '"') e = e.substr(1, e.size() - 2);
    return std::string(e);
  }

  // The ETag S3 gives the object completed from parts_[0, nparts): the MD5 of
  // their MD5s, "-N"; nullopt when a part's ETag is no MD5 (e.g. SSE-KMS).
  std::optional<std::string> MultipartEtag(uint64_t nparts) {
    std::string digests;
    for (uint64_t i = 0; i < nparts; ++i) {
      std::string e = Unquote(parts_[i].etag);
      if (e.size() != 32) return std::nullopt;
      for (size_t j = 0; j < 32; j += 2) {
        char* end = nullptr;
        std::string byte = e.substr(j, 2);
        long v = std::strtol(byte.c_str(), &end, 16);
        if (*end != '\0') return std::nullopt;
        digests.push_back(static_cast<char>(v));
      }
    }
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_Digest(digests.data(), digests.size(), md, &len, EVP_md5(), nullptr);
    static const char kHex[] = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < len; ++i) {
      out.push_back(kHex[md[i] >> 4]);
      out.push_back(kHex[md[i] & 15]);
    }
    return out + "-" + std::to_string(nparts);
  }

  void AbortUpload() {
    std::string id = UploadId();
    if (!id.empty()) s_->DeleteObject(full_, id).IgnoreError();
  }

  // Publishes the object (steps 3-4 of the protocol at the top).
  Status Finish() {
    Status s = [&]() -> Status {
      uint64_t total;
      {
        std::lock_guard<std::mutex> l(mu_);
        CAIRN_RETURN_IF_ERROR(error_);
        total = std::max(allocated_, end_);
      }
      if (UploadId().empty() && total <= part_size_) {
        auto it = parts_.find(0);
        const char* data = it != parts_.end() ? it->second.buf : nullptr;
        return s_->PutObject(full_, total ? data : "", total, false);
      }
      CAIRN_RETURN_IF_ERROR(EnsureUpload());
      const uint64_t nparts = (total + part_size_ - 1) / part_size_;
      {
        TaskGroup group(s_->pool());
        for (uint64_t i = 0; i < nparts; ++i) {
          Part* p = &parts_[i];
          if (p->sent) continue;
          p->sent = true;
          if (!p->buf) {
            std::lock_guard<std::mutex> l(mu_);
            p->buf = NewBuffer();
          }
          if (!p->buf) return ResourceExhaustedError(uri_ + ": cannot allocate a part buffer");
          uint64_t len = std::min(part_size_, total - i * part_size_);
          group.Run([this, i, p, len] { return SendPart(i, p, len); });
        }
        CAIRN_RETURN_IF_ERROR(group.Wait());
      }
      const bool crc = UploadChecksum() == BodyChecksum::kCrc32c;
      std::string body = "<CompleteMultipartUpload>";
      for (uint64_t i = 0; i < nparts; ++i) {
        body += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" +
                XmlEscape(parts_[i].etag) + "</ETag>";
        if (crc) {
          body +=
              "<ChecksumCRC32C>" + internal::Crc32cBase64(parts_[i].crc32c) + "</ChecksumCRC32C>";
        }
        body += "</Part>";
      }
      body += "</CompleteMultipartUpload>";
      Call c("POST", full_);
      c.query = {{"uploadId", UploadId()}};
      c.headers = {{"content-type", "application/xml"}};
      c.body = body.data();
      c.body_len = body.size();
      c.deadline = deadline_;
      // Only a CompleteMultipartUploadResult is a success: a 200 whose body
      // is an error, cut short or anything else is retried.
      c.expect_root = "CompleteMultipartUploadResult";
      pugi::xml_document doc;
      c.doc = &doc;
      Outcome o = s_->Execute(c, "completing the upload of " + uri_);
      if (o.status.code() == StatusCode::kNotFound && o.attempts > 1) {
        // NoSuchUpload after a retry: an earlier attempt may have completed
        // it. It did if the object is the one these parts make.
        std::optional<std::string> want = MultipartEtag(nparts);
        auto info = s_->Head(full_);
        if (want && info.ok() && *info && Unquote((*info)->etag) == *want) return Status::OK();
      }
      return o.status;
    }();
    bool abort = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      finished_ = true;
      if (!s.ok() && error_.ok()) error_ = s;
      abort = !s.ok();
      parts_.clear();
    }
    if (abort) AbortUpload();
    return s;
  }

  S3Storage* const s_;
  const std::string full_, uri_;
  uint64_t part_size_;
  const Clock::time_point deadline_;  // of the whole upload (S3Options::operation_deadline_s)
  std::mutex mu_;
  std::map<uint64_t, Part> parts_;  // node-based: Part* stay valid
  static constexpr size_t kSpareBuffers = 32;
  std::vector<char*> spare_;  // buffers of sent parts, for reuse (guarded by mu_)
  uint64_t allocated_ = 0, end_ = 0;
  bool closed_ = false, finished_ = false;
  Status error_;
  std::mutex upload_mu_;
  std::string upload_id_;
  BodyChecksum upload_checksum_ = BodyChecksum::kOff;  // fixed when the upload is created
  std::atomic<bool> parts_refuse_crc_{false};
};

class S3ReadableFile final : public ReadableFile {
 public:
  S3ReadableFile(S3Storage* s, std::string full, std::string uri, uint64_t size, std::string etag,
                 std::string head)
      : s_(s),
        full_(std::move(full)),
        uri_(std::move(uri)),
        size_(size),
        etag_(std::move(etag)),
        head_(std::move(head)) {}

  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    if (offset > size_ || n > size_ - offset) {
      return OutOfRangeError(uri_ + ": read of " + std::to_string(n) + " bytes at " +
                             std::to_string(offset) + " past the end (" + std::to_string(size_) +
                             " bytes)");
    }
    char* out = static_cast<char*>(buf);
    if (offset < head_.size()) {
      size_t k = std::min<uint64_t>(n, head_.size() - offset);
      std::memcpy(out, head_.data() + offset, k);
      out += k;
      offset += k;
      n -= k;
    }
    if (n == 0) return Status::OK();
    const uint64_t range = s_->options().part_size;
    const Clock::time_point deadline = s_->OperationDeadline();
    if (n <= 2 * range) return Get(offset, out, n, deadline);
    TaskGroup group(s_->pool());
    for (uint64_t done = 0; done < n; done += range) {
      uint64_t len = std::min<uint64_t>(range, n - done);
      group.Run([this, offset, out, done, len, deadline] {
        return Get(offset + done, out + done, len, deadline);
      });
    }
    return group.Wait();
  }

  uint64_t Size() const override { return size_; }

  // One ranged GET scattered over the segments (several neighbouring items
  // of a checkpoint: CheckpointReader coalesces reads below
  // PreferredReadSize). Ranges within the bytes fetched at open, or larger
  // than two parts, take the ReadAt path.
  Status ReadV(uint64_t offset, const std::vector<Segment>& segs) const override {
    uint64_t n = 0;
    for (const Segment& s : segs) n += s.n;
    if (offset > size_ || n > size_ - offset) {
      return OutOfRangeError(uri_ + ": read of " + std::to_string(n) + " bytes at " +
                             std::to_string(offset) + " past the end (" + std::to_string(size_) +
                             " bytes)");
    }
    if (n == 0) return Status::OK();
    if (offset < head_.size() || n > 2 * s_->options().part_size) {
      return ReadableFile::ReadV(offset, segs);
    }
    std::vector<std::pair<char*, size_t>> pieces;
    pieces.reserve(segs.size());
    for (const Segment& s : segs) pieces.emplace_back(s.buf, s.n);
    return Get(offset, nullptr, n, s_->OperationDeadline(), &pieces);
  }

  uint64_t PreferredReadSize() const override { return s_->options().part_size; }

 private:
  Status Get(uint64_t offset, char* out, uint64_t n, Clock::time_point deadline,
             const std::vector<std::pair<char*, size_t>>* scatter = nullptr) const {
    Call c("GET", full_);
    c.headers = {
        {"range", "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + n - 1)}};
    if (!etag_.empty()) c.headers.emplace_back("if-match", etag_);
    c.dest = out;
    c.dest_len = n;
    c.scatter = scatter;
    c.deadline = deadline;
    Outcome o = s_->Execute(c, "reading " + uri_);
    if (o.resp.status == 412) {
      return FailedPreconditionError(uri_ + ": replaced while it was being read");
    }
    CAIRN_RETURN_IF_ERROR(o.status);
    if (o.resp.dest_written != n) {
      return UnavailableError("reading " + uri_ + ": short response (" +
                              std::to_string(o.resp.dest_written) + " of " + std::to_string(n) +
                              " bytes)");
    }
    return Status::OK();
  }

  S3Storage* const s_;
  const std::string full_, uri_;
  const uint64_t size_;
  const std::string etag_, head_;
};

Result<std::unique_ptr<WritableFile>> S3Storage::NewWritableFile(std::string_view key,
                                                                 const WriteOptions&) {
  CAIRN_RETURN_IF_ERROR(ValidateKey(key));
  CAIRN_RETURN_IF_ERROR(CheckCreatable(key));
  return std::unique_ptr<WritableFile>(new S3WritableFile(this, Full(key), Uri(key)));
}

Result<std::unique_ptr<ReadableFile>> S3Storage::NewReadableFile(std::string_view key,
                                                                 const ReadOptions&) {
  CAIRN_RETURN_IF_ERROR(ValidateKey(key));
  const std::string full = Full(key), uri = Uri(key);
  // One ranged GET returns the size, the ETag and the first bytes.
  std::string head(std::max<uint64_t>(1, opts_.prefetch_bytes), '\0');
  Call c("GET", full);
  c.headers = {{"range", "bytes=0-" + std::to_string(head.size() - 1)}};
  c.dest = head.data();
  c.dest_len = head.size();
  Outcome o = Execute(c, "opening " + uri);
  if (o.resp.status == 404) return NotFoundError(uri + ": no such file");
  uint64_t size = 0;
  if (o.resp.status == 416) {
    // An empty object has no byte 0.
    CAIRN_ASSIGN_OR_RETURN(auto info, Head(full));
    if (!info) return NotFoundError(uri + ": no such file");
    if (info->size != 0) return UnavailableError("opening " + uri + ": changed while opened");
    return std::unique_ptr<ReadableFile>(new S3ReadableFile(this, full, uri, 0, info->etag, ""));
  }
  CAIRN_RETURN_IF_ERROR(o.status);
  if (o.resp.status == 206) {
    const std::string& cr = o.resp.headers["content-range"];  // "bytes 0-N/TOTAL"
    size_t slash = cr.rfind('/');
    if (slash == std::string::npos)
      return UnavailableError("opening " + uri + ": no Content-Range");
    size = std::strtoull(cr.c_str() + slash + 1, nullptr, 10);
  } else {
    size = o.resp.dest_written;  // 200: the whole object
  }
  head.resize(std::min<uint64_t>(o.resp.dest_written, size));
  return std::unique_ptr<ReadableFile>(
      new S3ReadableFile(this, full, uri, size, o.resp.headers["etag"], std::move(head)));
}

double EnvDouble(const char* name, double dflt) {
  std::string v = Env(name);
  if (v.empty()) return dflt;
  char* end = nullptr;
  double d = std::strtod(v.c_str(), &end);
  return end && *end == '\0' ? d : dflt;
}

}  // namespace

S3Options S3OptionsFromEnvironment() {
  S3Options o;
  // Unreadable or malformed AWS files leave the environment's settings;
  // NewS3Storage loads them again and reports the error.
  s3::EnvLookup env = s3::ProcessEnv();
  auto config = s3::AwsConfig::Load(env);
  auto settings = s3::ResolveS3Settings(env, config.ok() ? *config : s3::AwsConfig());
  if (settings.ok()) {
    o.endpoint = settings->endpoint;
    o.region = settings->region;
    o.addressing_style = settings->addressing == s3::AddressingStyle::kVirtual ? "virtual"
                         : settings->addressing == s3::AddressingStyle::kPath  ? "path"
                                                                               : "auto";
    o.ca_bundle = settings->ca_bundle;
  }
  o.part_size = static_cast<uint64_t>(EnvDouble("CAIRN_S3_PART_SIZE", o.part_size));
  o.concurrency = static_cast<int>(EnvDouble("CAIRN_S3_CONCURRENCY", o.concurrency));
  o.prefetch_bytes = static_cast<uint64_t>(EnvDouble("CAIRN_S3_PREFETCH", o.prefetch_bytes));
  o.max_attempts = static_cast<int>(EnvDouble("CAIRN_S3_MAX_ATTEMPTS", o.max_attempts));
  o.retry_deadline_s = EnvDouble("CAIRN_S3_RETRY_DEADLINE_S", o.retry_deadline_s);
  o.connect_timeout_s = EnvDouble("CAIRN_S3_CONNECT_TIMEOUT_S", o.connect_timeout_s);
  o.stall_timeout_s = EnvDouble("CAIRN_S3_STALL_TIMEOUT_S", o.stall_timeout_s);
  o.sign_payload = Env("CAIRN_S3_SIGN_PAYLOAD") == "1";
  o.operation_deadline_s = EnvDouble("CAIRN_S3_OPERATION_DEADLINE_S", o.operation_deadline_s);
  o.max_list_pages = static_cast<int>(
      std::clamp(EnvDouble("CAIRN_S3_MAX_LIST_PAGES", o.max_list_pages), 0.0, 1e9));
  if (std::string v = Env("CAIRN_S3_CHECKSUM"); !v.empty()) o.checksum = v;
  return o;
}

Result<std::unique_ptr<Storage>> NewS3Storage(std::string_view uri, const S3Options& opts,
                                              bool create) {
  constexpr std::string_view kScheme = "s3://";
  if (uri.substr(0, kScheme.size()) != kScheme) {
    return InvalidArgumentError("not an s3:// URI: " + std::string(uri));
  }
  std::string_view rest = uri.substr(kScheme.size());
  size_t slash = rest.find('/');
  std::string bucket(rest.substr(0, slash));
  std::string_view prefix = slash == std::string_view::npos ? "" : rest.substr(slash + 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.remove_suffix(1);
  if (bucket.empty() || bucket.size() > 63 ||
      bucket.find_first_not_of(
          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_") !=
          std::string::npos) {
    return InvalidArgumentError("invalid S3 bucket name in " + std::string(uri));
  }
  CAIRN_RETURN_IF_ERROR(ValidateKey(prefix, true).WithContext(std::string(uri)));
  if (opts.part_size < kMinPartSize) {
    return InvalidArgumentError("S3 part size " + std::to_string(opts.part_size) +
                                " is below S3's minimum of 5 MiB");
  }
  if (opts.max_attempts < 1) return InvalidArgumentError("S3 max_attempts must be >= 1");
  if (opts.max_list_pages < 1) return InvalidArgumentError("S3 max_list_pages must be >= 1");
  if (opts.checksum != "crc32c" && opts.checksum != "md5" && opts.checksum != "off") {
    return InvalidArgumentError("S3 checksum '" + opts.checksum.substr(0, 40) +
                                "' (CAIRN_S3_CHECKSUM) is not crc32c, md5 or off");
  }
  if (!(opts.operation_deadline_s > 0)) {
    return InvalidArgumentError("S3 operation_deadline_s must be > 0");
  }
  const std::string what = "opening " + std::string(uri);
  s3::AddressingStyle style;
  if (opts.addressing_style.empty() || opts.addressing_style == "auto") {
    style = s3::AddressingStyle::kAuto;
  } else if (opts.addressing_style == "virtual") {
    style = s3::AddressingStyle::kVirtual;
  } else if (opts.addressing_style == "path") {
    style = s3::AddressingStyle::kPath;
  } else {
    return InvalidArgumentError(what + ": addressing style '" + opts.addressing_style +
                                "' is not auto, virtual or path");
  }
  if (!opts.ca_bundle.empty() && ::access(opts.ca_bundle.c_str(), R_OK) != 0) {
    return InvalidArgumentError(
        what + ": CA bundle " + opts.ca_bundle +
        " (AWS_CA_BUNDLE or the profile's ca_bundle): " + std::strerror(errno));
  }
  auto addr = s3::ResolveS3Address(opts.endpoint, opts.region, bucket, style);
  if (!addr.ok()) return addr.status().WithContext(what);
  // The credential chain (credentials.h), over the same files and CA bundle.
  s3::EnvLookup env = s3::ProcessEnv();
  auto config = s3::AwsConfig::Load(env);
  if (!config.ok()) return config.status().WithContext(what);
  auto make = [&]() {
    auto ctx = std::make_shared<s3::ProviderContext>(
        s3::ProviderContext{env, *config, opts.region,
                            std::make_shared<s3::HttpClient>(s3::HttpOptions{opts.ca_bundle})});
    return std::make_shared<s3::RefreshingCredentials>(s3::DefaultProviderChain(ctx),
                                                       s3::RefreshWindowsFromEnv(env));
  };
  auto creds = s3::SharedCredentials(
      s3::ProcessCredentialFingerprint(opts.region + '\0' + opts.ca_bundle), make);
  if (!creds.ok()) {
    Status st = creds.status();
    // A missing profile, token file or role is a configuration error, not
    // an absent checkpoint (callers treat kNotFound as "nothing there yet").
    if (st.code() == StatusCode::kNotFound) st = FailedPreconditionError(st.message());
    return st.WithContext(what + ": AWS credentials");
  }
  auto s = std::make_unique<S3Storage>(opts, std::move(*creds), std::move(*addr), bucket,
                                       std::string(prefix));
  auto any = s->AnyBelow(s->DirPrefix(""));
  if (!any.ok()) return any.status().WithContext("opening " + s->Describe());
  if (!create && !*any && !prefix.empty()) {
    return NotFoundError("no such S3 prefix: " + s->Describe());
  }
  return std::unique_ptr<Storage>(std::move(s));
}

}  // namespace cairn
