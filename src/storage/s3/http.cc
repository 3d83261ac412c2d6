// HttpClient over libcurl (see http.h).
#include "storage/s3/http.h"

#include <curl/curl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstring>

namespace cairn::s3 {
namespace {

// curl_global_init is not thread-safe; run it once, before any handle.
struct CurlGlobal {
  CurlGlobal() { curl_global_init(CURL_GLOBAL_DEFAULT); }
};
void EnsureCurlGlobal() { static CurlGlobal g; }

struct Transfer {
  CURL* curl;
  const HttpRequest* req;
  HttpResponse* resp;
  size_t piece = 0;     // scatter: the piece being filled
  size_t piece_at = 0;  // and the bytes of it already filled
  size_t header_bytes = 0;
};

// Places a body chunk into req.scatter (see HttpRequest); false on overflow.
bool Scatter(Transfer* t, const char* data, size_t len) {
  const auto& pieces = *t->req->scatter;
  while (len > 0) {
    if (t->piece >= pieces.size()) return false;
    const auto& [buf, n] = pieces[t->piece];
    size_t k = std::min(len, n - t->piece_at);
    if (buf) std::memcpy(buf + t->piece_at, data, k);
    t->piece_at += k;
    t->resp->dest_written += k;
    data += k;
    len -= k;
    if (t->piece_at == n) {
      ++t->piece;
      t->piece_at = 0;
    }
  }
  return true;
}

size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  std::string_view line(data, size * n);
  if (line.substr(0, 5) == "HTTP/") {
    t->resp->headers.clear();  // a new response (e.g. after 100 Continue)
    t->header_bytes = 0;
    return size * n;
  }
  // A server's headers are not trusted to be few or short.
  t->header_bytes += line.size();
  if (t->header_bytes > kMaxHeaderBytes) {
    t->resp->header_overflow = true;
    return 0;  // aborts the transfer
  }
  size_t colon = line.find(':');
  if (colon != std::string_view::npos) {
    std::string name(line.substr(0, colon));
    for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string_view v = line.substr(colon + 1);
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ')) {
      v.remove_suffix(1);
    }
    t->resp->headers[name] = std::string(v);
  }
  return size * n;
}

size_t OnBody(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  size_t len = size * n;
  long code = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &code);
  if (t->req->scatter && code >= 200 && code < 300) {
    if (!Scatter(t, data, len)) {
      t->resp->dest_overflow = true;
      return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
    }
    return len;
  }
  if (t->req->dest && code >= 200 && code < 300) {
    HttpResponse* r = t->resp;
    if (r->dest_written + len > t->req->dest_len) {
      r->dest_overflow = true;
      return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
    }
    std::memcpy(t->req->dest + r->dest_written, data, len);
    r->dest_written += len;
    return len;
  }
  // Other bodies (XML results, errors) are kept up to max_body: a 2xx one
  // that is longer is refused whole, an error body is cut.
  HttpResponse* r = t->resp;
  const size_t room = t->req->max_body - std::min(t->req->max_body, r->body.size());
  if (len > room) {
    if (code >= 200 && code < 300) {
      r->body_overflow = true;
      return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
    }
    r->body.append(data, room);
    return len;
  }
  r->body.append(data, len);
  return len;
}

}  // namespace

struct HttpClient::Share {
  CURLSH* sh = nullptr;
  std::mutex locks[CURL_LOCK_DATA_LAST];
  static void Lock(CURL*, curl_lock_data d, curl_lock_access, void* u) {
    static_cast<Share*>(u)->locks[d].lock();
  }
  static void Unlock(CURL*, curl_lock_data d, void* u) {
    static_cast<Share*>(u)->locks[d].unlock();
  }
};

HttpClient::HttpClient(HttpOptions opts)
    : opts_(std::move(opts)), share_(std::make_unique<Share>()) {
  EnsureCurlGlobal();
  struct stat st;
  ca_is_dir_ =
      !opts_.ca_bundle.empty() && ::stat(opts_.ca_bundle.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  share_->sh = curl_share_init();
  curl_share_setopt(share_->sh, CURLSHOPT_LOCKFUNC, &Share::Lock);
  curl_share_setopt(share_->sh, CURLSHOPT_UNLOCKFUNC, &Share::Unlock);
  curl_share_setopt(share_->sh, CURLSHOPT_USERDATA, share_.get());
  curl_share_setopt(share_->sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
  curl_share_setopt(share_->sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
}

HttpClient::~HttpClient() {
  for (void* h : idle_) curl_easy_cleanup(static_cast<CURL*>(h));
  curl_share_cleanup(share_->sh);
}

void* HttpClient::Borrow() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!idle_.empty()) {
      void* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  return curl_easy_init();
}

void HttpClient::Return(void* handle) {
  std::lock_guard<std::mutex> l(mu_);
  idle_.push_back(handle);
}

namespace {
constexpr long kRecvBufferBytes = 1L << 20;    // CURL_MAX_READ_SIZE is 10 MiB
constexpr long kUploadBufferBytes = 2L << 20;  // curl's maximum
}  // namespace

HttpResponse HttpClient::Perform(const HttpRequest& req) {
  HttpResponse resp;
  CURL* curl = static_cast<CURL*>(Borrow());
  if (!curl) {
    resp.curl_code = CURLE_OUT_OF_MEMORY;
    resp.curl_error = "cannot create a curl handle";
    return resp;
  }
  curl_easy_reset(curl);  // keeps live connections and caches
  Transfer t{curl, &req, &resp};
  char errbuf[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_SHARE, share_->sh);
  curl_easy_setopt(curl, CURLOPT_URL, req.url.c_str());
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &OnHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &t);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &OnBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(curl, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(curl, CURLOPT_TCP_KEEPALIVE, 1L);
  // TLS: verify the peer and its name, always (curl's defaults, set anyway
  // so that nothing inherited can turn them off).
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYPEER, 1L);
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYHOST, 2L);
  if (!opts_.ca_bundle.empty()) {
    curl_easy_setopt(curl, ca_is_dir_ ? CURLOPT_CAPATH : CURLOPT_CAINFO, opts_.ca_bundle.c_str());
  }
  // Large socket reads and writes: curl's defaults (16 KiB receive, 64 KiB
  // upload buffer) cut an 8 MiB part into hundreds of send/recv calls, and
  // each one is a wakeup of the server's thread too (moto's, under its GIL,
  // took twice the CPU per byte for cairn's ranged GETs as for boto3's).
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, kRecvBufferBytes);
  curl_easy_setopt(curl, CURLOPT_UPLOAD_BUFFERSIZE, kUploadBufferBytes);
  if (req.connect_timeout_ms > 0) {
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, req.connect_timeout_ms);
  }
  if (req.stall_timeout_ms > 0) {
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, std::max(1L, req.stall_timeout_ms / 1000));
  }
  if (req.total_timeout_ms > 0) curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, req.total_timeout_ms);
  if (req.fresh_connection) curl_easy_setopt(curl, CURLOPT_FRESH_CONNECT, 1L);

  if (req.method == "GET") {
    curl_easy_setopt(curl, CURLOPT_HTTPGET, 1L);
  } else if (req.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else {
    // PUT, POST and DELETE send their body (possibly empty) from memory, so a
    // retry needs no rewind.
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, req.method.c_str());
    if (req.method != "DELETE" || req.body_len > 0) {
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, req.body ? req.body : "");
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(req.body_len));
    }
  }
  curl_slist* hdrs = nullptr;
  for (const auto& [k, v] : req.headers) {
    hdrs = curl_slist_append(hdrs, (k + ": " + v).c_str());
  }
  // No "Expect: 100-continue" round trip, no form content type.
  hdrs = curl_slist_append(hdrs, "Expect:");
  bool has_type = std::any_of(req.headers.begin(), req.headers.end(),
                              [](const auto& h) { return h.first == "content-type"; });
  if (!has_type) hdrs = curl_slist_append(hdrs, "Content-Type:");
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, hdrs);

  CURLcode rc = curl_easy_perform(curl);
  curl_slist_free_all(hdrs);
  long code = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &code);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, nullptr);
  resp.curl_code = rc;
  if (rc != CURLE_OK) {
    resp.status = 0;
    resp.curl_error = errbuf[0] ? errbuf : curl_easy_strerror(rc);
    resp.timed_out = rc == CURLE_OPERATION_TIMEDOUT;
    resp.tls_unverified = rc == CURLE_PEER_FAILED_VERIFICATION || rc == CURLE_SSL_CACERT_BADFILE;
    // A connection that failed mid-transfer is not reused by curl.
  } else {
    resp.status = static_cast<int>(code);
  }
  Return(curl);
  return resp;
}

}  // namespace cairn::s3
