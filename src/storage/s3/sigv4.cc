// SigV4 signing (see sigv4.h).
#include "storage/s3/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cctype>
#include <ctime>

namespace cairn::s3 {
namespace {

std::string Hex(const unsigned char* p, size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '\0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[p[i] >> 4];
    out[2 * i + 1] = kDigits[p[i] & 15];
  }
  return out;
}

std::string Hmac(std::string_view key, std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
  return std::string(reinterpret_cast<char*>(out), len);
}

std::string Trim(std::string_view v) {
  size_t b = 0, e = v.size();
  while (b < e && (v[b] == ' ' || v[b] == '\t')) ++b;
  while (e > b && (v[e - 1] == ' ' || v[e - 1] == '\t')) --e;
  // Sequential spaces inside a value collapse to one.
  std::string out;
  for (size_t i = b; i < e; ++i) {
    if (v[i] == ' ' && !out.empty() && out.back() == ' ') continue;
    out.push_back(v[i]);
  }
  return out;
}

}  // namespace

std::string Sha256Hex(const void* data, size_t n) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, n, out, &len, EVP_sha256(), nullptr);
  return Hex(out, len);
}

std::string Md5Base64(const void* data, size_t n) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, n, out, &len, EVP_md5(), nullptr);
  std::string b64(4 * ((len + 2) / 3) + 1, '\0');
  int w = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(b64.data()), out, len);
  b64.resize(w);
  return b64;
}

std::string UriEncode(std::string_view s, bool encode_slash) {
  static const char kDigits[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' ||
        (c == '/' && !encode_slash)) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kDigits[c >> 4]);
      out.push_back(kDigits[c & 15]);
    }
  }
  return out;
}

std::string CanonicalQuery(std::vector<std::pair<std::string, std::string>> query) {
  for (auto& [k, v] : query) {
    k = UriEncode(k, true);
    v = UriEncode(v, true);
  }
  std::sort(query.begin(), query.end());
  std::string out;
  for (const auto& [k, v] : query) {
    if (!out.empty()) out.push_back('&');
    out += k + "=" + v;
  }
  return out;
}

std::string CanonicalRequest(const SignRequest& req, std::string* signed_headers) {
  std::vector<std::pair<std::string, std::string>> hs;
  for (const auto& [k, v] : req.headers) {
    std::string name = k;
    for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    hs.emplace_back(std::move(name), Trim(v));
  }
  std::sort(hs.begin(), hs.end());
  std::string canonical_headers;
  signed_headers->clear();
  for (const auto& [k, v] : hs) {
    canonical_headers += k + ":" + v + "\n";
    if (!signed_headers->empty()) signed_headers->push_back(';');
    *signed_headers += k;
  }
  return req.method + "\n" + req.canonical_uri + "\n" + req.canonical_query + "\n" +
         canonical_headers + "\n" + *signed_headers + "\n" + req.payload_hash;
}

std::string Authorization(const Credentials& creds, const SignRequest& req) {
  std::string signed_headers;
  std::string canonical = CanonicalRequest(req, &signed_headers);
  std::string date = req.amz_date.substr(0, 8);
  std::string scope = date + "/" + req.region + "/" + req.service + "/aws4_request";
  std::string to_sign = "AWS4-HMAC-SHA256\n" + req.amz_date + "\n" + scope + "\n" +
                        Sha256Hex(canonical.data(), canonical.size());
  std::string key = Hmac("AWS4" + creds.secret_access_key, date);
  key = Hmac(key, req.region);
  key = Hmac(key, req.service);
  key = Hmac(key, "aws4_request");
  std::string sig = Hmac(key, to_sign);
  return "AWS4-HMAC-SHA256 Credential=" + creds.access_key_id + "/" + scope +
         ", SignedHeaders=" + signed_headers +
         ", Signature=" + Hex(reinterpret_cast<const unsigned char*>(sig.data()), sig.size());
}

std::string AmzDateNow() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

}  // namespace cairn::s3
