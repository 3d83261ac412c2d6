// HttpClient: blocking HTTP requests over libcurl with connection reuse
// (internal to the s3 backend).
//
// A pool of curl easy handles is kept; each handle keeps its own live
// connections between requests (curl_easy_reset keeps them), and all
// handles share one DNS and TLS-session cache through a curl share object.
// Thread-safe: Perform() may be called from many threads at once; each call
// borrows a handle for its duration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace cairn::s3 {

struct HttpRequest {
  std::string method;  // GET HEAD PUT POST DELETE
  std::string url;
  std::vector<std::pair<std::string, std::string>> headers;
  const char* body = nullptr;  // request body (not copied), body_len bytes
  size_t body_len = 0;
  // When set, a 2xx response body is written here (at most dest_len bytes;
  // more is an error) instead of into HttpResponse::body.
  char* dest = nullptr;
  size_t dest_len = 0;
  // Instead of dest: a 2xx body is scattered over these (address, length)
  // pieces in order, a null address skipping its bytes; more bytes than
  // they hold is an error. dest_written counts every byte placed or skipped.
  const std::vector<std::pair<char*, size_t>>* scatter = nullptr;
  // Bytes of a body kept in HttpResponse::body (one not written to dest or
  // scatter): a 2xx body longer than this aborts the transfer
  // (body_overflow); a longer error body is cut here, the rest discarded.
  size_t max_body = 64 << 10;
  // On a new connection: curl silently resends a request whose reused
  // connection died before any answer, which for a request that must not
  // take effect twice hides that it may have (see S3WritableFile).
  bool fresh_connection = false;
  // Limits of this attempt, in milliseconds (0 = none).
  long connect_timeout_ms = 0;
  long stall_timeout_ms = 0;  // abort when no byte moves for this long
  long total_timeout_ms = 0;
};

struct HttpResponse {
  int status = 0;                              // HTTP status; 0 when the transfer failed
  int curl_code = 0;                           // CURLcode; 0 on success
  std::string curl_error;                      // curl's message for curl_code
  bool timed_out = false;                      // the transfer hit a timeout or the stall limit
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  size_t dest_written = 0;
  bool dest_overflow = false;
  // The peer's TLS certificate failed verification (retrying cannot help).
  bool tls_unverified = false;
  bool body_overflow = false;    // a 2xx body over max_body (the transfer was aborted)
  bool header_overflow = false;  // more header bytes than kMaxHeaderBytes (aborted)
};

// TLS settings of one client. Peer and host verification are always on.
struct HttpOptions {
  // A PEM file of CA certificates to trust instead of the system's
  // (AWS_CA_BUNDLE or a profile's ca_bundle); a directory is used as a
  // hashed CA directory (CURLOPT_CAPATH). "" = the system's store.
  std::string ca_bundle;
};

// Bound on the response header bytes kept per response.
inline constexpr size_t kMaxHeaderBytes = 256 << 10;

class HttpClient {
 public:
  explicit HttpClient(HttpOptions opts = {});
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Runs one request to completion (no retries: see S3Storage).
  HttpResponse Perform(const HttpRequest& req);

 private:
  void* Borrow();
  void Return(void* handle);

  struct Share;
  const HttpOptions opts_;
  bool ca_is_dir_ = false;
  std::unique_ptr<Share> share_;
  std::mutex mu_;
  std::vector<void*> idle_;
};

}  // namespace cairn::s3
