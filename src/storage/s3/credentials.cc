// The AWS credential provider chain (see credentials.h for the order and the
// rules; docs/storage.md for the table against boto3).
//
// Wire protocols, as AWS documents them:
//   STS      POST https://sts.REGION.amazonaws.com/ (or AWS_ENDPOINT_URL_STS),
//            form body Action=AssumeRoleWithWebIdentity|AssumeRole&Version=
//            2011-06-15&RoleArn=..&RoleSessionName=..[&WebIdentityToken=..];
//            AssumeRole is SigV4-signed for service "sts" with the source
//            credentials, AssumeRoleWithWebIdentity is unsigned. The answer
//            is XML: <ActionResponse><ActionResult><Credentials>
//            AccessKeyId SecretAccessKey SessionToken Expiration.
//   IMDSv2   PUT /latest/api/token with x-aws-ec2-metadata-token-ttl-seconds
//            -> a token; GET /latest/meta-data/iam/security-credentials/ with
//            x-aws-ec2-metadata-token -> the role name; GET .../ROLE -> JSON
//            {Code, AccessKeyId, SecretAccessKey, Token, Expiration}. A 403,
//            404 or 405 to the PUT falls back to IMDSv1 (no token) unless
//            AWS_EC2_METADATA_V1_DISABLED=true.
//   Container GET the URL (169.254.170.2 + RELATIVE_URI, or FULL_URI) with
//            Authorization: the token -> the same JSON (no Code).
//   Process  sh -c COMMAND; stdout is JSON {Version: 1, AccessKeyId,
//            SecretAccessKey, SessionToken, Expiration}.
#include "storage/s3/credentials.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <nlohmann/json.hpp>
#include <pugixml.hpp>
#include <set>

extern char** environ;

namespace cairn::s3 {
namespace {

constexpr size_t kMaxAnswerBytes = 64 << 10;
constexpr int kMaxProfileDepth = 8;

// A piece of untrusted text fit to quote in an error: at most `n` bytes,
// control characters replaced.
std::string Cut(std::string_view s, size_t n = 200) {
  std::string out;
  for (char c : s.substr(0, n)) {
    out.push_back(std::iscntrl(static_cast<unsigned char>(c)) ? ' ' : c);
  }
  if (s.size() > n) out += "...";
  return out;
}

std::string Lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string Trim(std::string s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  size_t e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// A token file (web identity, container authorization): at most 64 KiB.
// Errors name the file, never its content.
Result<std::string> ReadTokenFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoToStatus(errno, std::string("reading ") + what + " " + path);
  std::string text(kMaxAnswerBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxAnswerBytes) {
    return InvalidArgumentError(std::string(what) + " " + path + " is larger than 64 KiB");
  }
  text = Trim(text);
  if (text.empty()) return InvalidArgumentError(std::string(what) + " " + path + " is empty");
  return text;
}

struct Answer {
  int status = 0;
  std::string body;
};

// One small request whose answer is untrusted: 2xx bodies over 64 KiB are
// refused, transport failures are kUnavailable.
Result<Answer> Fetch(HttpClient& http, HttpRequest req, const std::string& what, long timeout_ms) {
  std::string buf(kMaxAnswerBytes, '\0');
  req.dest = buf.data();
  req.dest_len = buf.size();
  req.connect_timeout_ms = timeout_ms;
  req.total_timeout_ms = timeout_ms;
  HttpResponse r = http.Perform(req);
  if (r.curl_code != 0) {
    if (r.dest_overflow) return UnavailableError(what + ": answer larger than 64 KiB");
    if (r.tls_unverified) {
      return FailedPreconditionError(what + ": TLS certificate not trusted (" + Cut(r.curl_error) +
                                     ")");
    }
    return UnavailableError(what + ": " + (r.timed_out ? "timed out" : "request failed") + " (" +
                            Cut(r.curl_error) + ")");
  }
  Answer a;
  a.status = r.status;
  if (r.status >= 200 && r.status < 300) {
    buf.resize(r.dest_written);
    a.body = std::move(buf);
  } else {
    a.body = r.body.substr(0, kMaxAnswerBytes);
  }
  return a;
}

// Runs `fn` up to 3 times while it fails with kUnavailable.
template <typename Fn>
auto Retrying(Fn fn) -> decltype(fn()) {
  for (int attempt = 1;; ++attempt) {
    auto r = fn();
    if (r.ok() || r.status().code() != StatusCode::kUnavailable || attempt >= 3) return r;
    std::this_thread::sleep_for(std::chrono::milliseconds(100 * attempt));
  }
}

Status HttpStatusError(int status, const std::string& what, const std::string& detail) {
  std::string msg =
      what + ": HTTP " + std::to_string(status) + (detail.empty() ? "" : " ") + detail;
  if (status == 401 || status == 403) return PermissionDeniedError(msg);
  if (status == 400) return PermissionDeniedError(msg);
  if (status == 404) return NotFoundError(msg);
  if (status == 408 || status == 429 || status >= 500) return UnavailableError(msg);
  return IOError(msg);
}

std::string HostOf(const std::string& url, std::string* path) {
  size_t scheme = url.find("://");
  size_t start = scheme == std::string::npos ? 0 : scheme + 3;
  size_t slash = url.find('/', start);
  *path = slash == std::string::npos ? "/" : url.substr(slash);
  return url.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
}

std::string FormEncode(const std::vector<std::pair<std::string, std::string>>& params) {
  std::string out;
  for (const auto& [k, v] : params) {
    if (!out.empty()) out += "&";
    out += UriEncode(k, true) + "=" + UriEncode(v, true);
  }
  return out;
}

std::string DefaultSessionName() {
  return "cairn-session-" + std::to_string(static_cast<long long>(std::time(nullptr)));
}

// One STS call; `signer` null = unsigned (AssumeRoleWithWebIdentity).
Result<TimedCredentials> CallSts(const ProviderContext& ctx, const std::string& action,
                                 std::vector<std::pair<std::string, std::string>> params,
                                 const Credentials* signer, const std::string& source) {
  std::string endpoint = ServiceEndpoint(ctx.env, ctx.config, "sts", ctx.region);
  while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
  params.insert(params.begin(), {{"Action", action}, {"Version", "2011-06-15"}});
  const std::string body = FormEncode(params);
  std::string path;
  const std::string host = HostOf(endpoint, &path);
  const std::string what = "STS " + action + " at " + Cut(endpoint, 100);
  auto once = [&]() -> Result<TimedCredentials> {
    HttpRequest req;
    req.method = "POST";
    req.url = endpoint + "/";
    req.body = body.data();
    req.body_len = body.size();
    std::vector<std::pair<std::string, std::string>> hs = {
        {"content-type", "application/x-www-form-urlencoded; charset=utf-8"},
        {"accept", "application/xml"}};
    if (signer) {
      std::string date = AmzDateNow();
      std::string payload = Sha256Hex(body.data(), body.size());
      hs.emplace_back("host", host);
      hs.emplace_back("x-amz-date", date);
      hs.emplace_back("x-amz-content-sha256", payload);
      if (!signer->session_token.empty()) {
        hs.emplace_back("x-amz-security-token", signer->session_token);
      }
      SignRequest sr{"POST", "/", "", hs, payload, date, ctx.region, "sts"};
      std::string auth = Authorization(*signer, sr);
      hs.emplace_back("authorization", std::move(auth));
    }
    req.headers = std::move(hs);
    CAIRN_ASSIGN_OR_RETURN(Answer a, Fetch(*ctx.http, req, what, 10000));
    if (a.status < 200 || a.status >= 300) {
      std::string detail;
      pugi::xml_document doc;
      if (doc.load_buffer(a.body.data(), a.body.size())) {
        // STS: ErrorResponse/Error; moto and EC2-style: .../Errors/Error.
        pugi::xml_node e = doc.child("ErrorResponse").child("Error");
        if (!e) e = doc.child("ErrorResponse").child("Errors").child("Error");
        if (!e) e = doc.child("Response").child("Errors").child("Error");
        if (!e) e = doc.child("Error");
        detail = Cut(e.child_value("Code"), 64);
        std::string m = e.child_value("Message");
        if (!m.empty()) detail += ": " + Cut(m);
      }
      if (detail.find("Throttl") != std::string::npos)
        return UnavailableError(what + ": " + detail);
      return HttpStatusError(a.status, what, detail);
    }
    auto r = ParseStsResponse(a.body, action);
    if (!r.ok()) return r.status().WithContext(what);
    r->source = source;
    return r;
  };
  return Retrying(once);
}

// ---- environment ---------------------------------------------------------------

class EnvProvider final : public CredentialProvider {
 public:
  explicit EnvProvider(std::shared_ptr<ProviderContext> ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override { return "environment (AWS_ACCESS_KEY_ID)"; }
  Result<std::optional<TimedCredentials>> Load() override {
    const EnvLookup& env = ctx_->env;
    TimedCredentials t;
    t.creds = {env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"), env("AWS_SESSION_TOKEN")};
    t.source = "environment";
    if (t.creds.access_key_id.empty() && t.creds.secret_access_key.empty()) {
      return std::optional<TimedCredentials>();
    }
    if (t.creds.access_key_id.empty() || t.creds.secret_access_key.empty()) {
      return InvalidArgumentError(
          "partial credentials in the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
          "must both be set");
    }
    std::string exp = env("AWS_CREDENTIAL_EXPIRATION");
    if (!exp.empty()) {
      t.expiration = ParseIso8601(exp);
      if (!t.expiration) {
        return InvalidArgumentError("AWS_CREDENTIAL_EXPIRATION '" + Cut(exp, 40) +
                                    "' is not an ISO 8601 time");
      }
    }
    return std::optional<TimedCredentials>(std::move(t));
  }

 private:
  std::shared_ptr<ProviderContext> ctx_;
};

// ---- web identity ----------------------------------------------------------------

Result<TimedCredentials> AssumeRoleWithWebIdentity(const ProviderContext& ctx,
                                                   const std::string& token_file,
                                                   const std::string& role_arn, std::string session,
                                                   const char* source) {
  CAIRN_ASSIGN_OR_RETURN(std::string token, ReadTokenFile(token_file, "web identity token file"));
  if (session.empty()) session = DefaultSessionName();
  return CallSts(ctx, "AssumeRoleWithWebIdentity",
                 {{"RoleArn", role_arn}, {"RoleSessionName", session}, {"WebIdentityToken", token}},
                 nullptr, source);
}

class WebIdentityProvider final : public CredentialProvider {
 public:
  explicit WebIdentityProvider(std::shared_ptr<ProviderContext> ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override { return "web identity (AWS_WEB_IDENTITY_TOKEN_FILE)"; }
  Result<std::optional<TimedCredentials>> Load() override {
    std::string file = ctx_->env("AWS_WEB_IDENTITY_TOKEN_FILE");
    std::string role = ctx_->env("AWS_ROLE_ARN");
    if (file.empty() && role.empty()) return std::optional<TimedCredentials>();
    if (file.empty() || role.empty()) {
      return InvalidArgumentError(
          "web identity: AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN must both be set");
    }
    CAIRN_ASSIGN_OR_RETURN(
        TimedCredentials t,
        AssumeRoleWithWebIdentity(*ctx_, file, role, ctx_->env("AWS_ROLE_SESSION_NAME"),
                                  "web identity"));
    return std::optional<TimedCredentials>(std::move(t));
  }

 private:
  std::shared_ptr<ProviderContext> ctx_;
};

// ---- credential_process -------------------------------------------------------------

// Runs `command` with sh -c, returns its stdout (at most 64 KiB, within
// 60 s). Its stderr goes where ours goes; its output is never quoted.
Result<std::string> RunCredentialProcess(const std::string& command) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return ErrnoToStatus(errno, "credential_process: pipe");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t pid = 0;
  int rc = posix_spawn(&pid, "/bin/sh", &fa, &attr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return ErrnoToStatus(rc, "credential_process: starting /bin/sh");
  }
  std::string out;
  Status failure;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
    if (left <= 0) {
      failure = DeadlineExceededError("credential_process did not finish within 60 s");
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    int n = poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      failure = ErrnoToStatus(errno, "credential_process: poll");
      break;
    }
    if (n == 0) continue;
    char buf[4096];
    ssize_t k = read(fds[0], buf, sizeof buf);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;  // EOF (or an error: the exit status decides)
    out.append(buf, static_cast<size_t>(k));
    if (out.size() > kMaxAnswerBytes) {
      failure = InvalidArgumentError("credential_process wrote more than 64 KiB");
      break;
    }
  }
  close(fds[0]);
  if (!failure.ok()) kill(-pid, SIGKILL);
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (!failure.ok()) return failure;
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return PermissionDeniedError("credential_process failed (" +
                                 (WIFEXITED(wstatus)
                                      ? "exit status " + std::to_string(WEXITSTATUS(wstatus))
                                      : "killed by signal " + std::to_string(WTERMSIG(wstatus))) +
                                 ")");
  }
  return out;
}

// ---- container ------------------------------------------------------------------------

bool AllowedHttpHost(std::string host) {
  // Strip the port ("[::1]:80", "127.0.0.1:80").
  if (!host.empty() && host[0] == '[') {
    size_t close_br = host.find(']');
    host = close_br == std::string::npos ? host : host.substr(0, close_br + 1);
  } else if (size_t colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  host = Lower(host);
  if (host == "localhost" || host == "[::1]" || host == "169.254.170.2" ||
      host == "169.254.170.23" || host == "[fd00:ec2::23]") {
    return true;
  }
  // 127.0.0.0/8
  unsigned a, b, c, d;
  char tail;
  if (std::sscanf(host.c_str(), "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4) {
    return a == 127 && b < 256 && c < 256 && d < 256;
  }
  return false;
}

class ContainerProvider final : public CredentialProvider {
 public:
  explicit ContainerProvider(std::shared_ptr<ProviderContext> ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override {
    return "container (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI / _FULL_URI)";
  }
  Result<std::optional<TimedCredentials>> Load() override {
    CAIRN_ASSIGN_OR_RETURN(std::string url, ContainerCredentialsUrl(ctx_->env));
    if (url.empty()) return std::optional<TimedCredentials>();
    HttpRequest req;
    req.method = "GET";
    req.url = url;
    req.headers = {{"accept", "application/json"}};
    std::string token;
    std::string token_file = ctx_->env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
    if (!token_file.empty()) {
      CAIRN_ASSIGN_OR_RETURN(token,
                             ReadTokenFile(token_file, "container authorization token file"));
    } else {
      token = ctx_->env("AWS_CONTAINER_AUTHORIZATION_TOKEN");
    }
    if (token.find_first_of("\r\n") != std::string::npos) {
      return InvalidArgumentError("the container authorization token holds a line break");
    }
    if (!token.empty()) req.headers.emplace_back("authorization", token);
    const std::string what = "container credentials endpoint " + Cut(url, 100);
    CAIRN_ASSIGN_OR_RETURN(TimedCredentials t, Retrying([&]() -> Result<TimedCredentials> {
                             CAIRN_ASSIGN_OR_RETURN(Answer a, Fetch(*ctx_->http, req, what, 5000));
                             if (a.status != 200) {
                               return HttpStatusError(a.status, what, "");
                             }
                             return ParseCredentialsJson(a.body, what, false);
                           }));
    t.source = "container";
    return std::optional<TimedCredentials>(std::move(t));
  }

 private:
  std::shared_ptr<ProviderContext> ctx_;
};

// ---- instance metadata --------------------------------------------------------------------

bool ValidRoleName(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || std::strchr("+=,.@_-", c))) return false;
  }
  return true;
}

class InstanceMetadataProvider final : public CredentialProvider {
 public:
  explicit InstanceMetadataProvider(std::shared_ptr<ProviderContext> ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override {
    std::lock_guard<std::mutex> l(mu_);
    return "instance metadata (IMDS" + (absent_.empty() ? "" : ": " + absent_) + ")";
  }
  Result<std::optional<TimedCredentials>> Load() override {
    const EnvLookup& env = ctx_->env;
    if (Lower(env("AWS_EC2_METADATA_DISABLED")) == "true") {
      SetAbsent("disabled by AWS_EC2_METADATA_DISABLED");
      return std::optional<TimedCredentials>();
    }
    std::string base = env("AWS_EC2_METADATA_SERVICE_ENDPOINT");
    if (base.empty()) base = ctx_->config.Get("ec2_metadata_service_endpoint");
    if (base.empty()) {
      std::string mode = env("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE");
      if (mode.empty()) mode = ctx_->config.Get("ec2_metadata_service_endpoint_mode");
      base = Lower(mode) == "ipv6" ? "http://[fd00:ec2::254]" : "http://169.254.169.254";
    }
    while (!base.empty() && base.back() == '/') base.pop_back();
    long timeout_ms = 1000;
    if (std::string t = env("AWS_METADATA_SERVICE_TIMEOUT"); !t.empty()) {
      timeout_ms = std::clamp(std::atol(t.c_str()), 1L, 60L) * 1000;
    }
    const std::string what = "instance metadata service " + Cut(base, 100);

    // IMDSv2 session token.
    HttpRequest put;
    put.method = "PUT";
    put.url = base + "/latest/api/token";
    put.headers = {{"x-aws-ec2-metadata-token-ttl-seconds", "21600"}};
    auto tok = Fetch(*ctx_->http, put, what, timeout_ms);
    if (!tok.ok()) {  // nothing answers: not on EC2
      SetAbsent(tok.status().message());
      return std::optional<TimedCredentials>();
    }
    std::string token;
    if (tok->status == 200) {
      token = Trim(tok->body);
      if (token.empty() || token.size() > 4096 ||
          token.find_first_of("\r\n") != std::string::npos) {
        return UnavailableError(what + ": malformed session token");
      }
    } else if ((tok->status == 403 || tok->status == 404 || tok->status == 405) &&
               Lower(env("AWS_EC2_METADATA_V1_DISABLED")) != "true") {
      // IMDSv1 only (botocore's fallback).
    } else {
      return HttpStatusError(tok->status, what + ": PUT /latest/api/token", "");
    }
    auto get = [&](const std::string& path) -> Result<Answer> {
      HttpRequest req;
      req.method = "GET";
      req.url = base + path;
      if (!token.empty()) req.headers.emplace_back("x-aws-ec2-metadata-token", token);
      return Retrying([&]() -> Result<Answer> {
        CAIRN_ASSIGN_OR_RETURN(Answer a, Fetch(*ctx_->http, req, what, timeout_ms));
        if (a.status >= 500) return HttpStatusError(a.status, what + ": GET " + path, "");
        return a;
      });
    };
    const std::string list = "/latest/meta-data/iam/security-credentials/";
    CAIRN_ASSIGN_OR_RETURN(Answer roles, get(list));
    if (roles.status == 404) {
      SetAbsent("the instance has no IAM role");
      return std::optional<TimedCredentials>();
    }
    if (roles.status != 200) return HttpStatusError(roles.status, what + ": GET " + list, "");
    std::string role = Trim(roles.body.substr(0, roles.body.find('\n')));
    if (!ValidRoleName(role)) {
      return UnavailableError(what + ": malformed role name '" + Cut(role, 64) + "'");
    }
    CAIRN_ASSIGN_OR_RETURN(Answer creds, get(list + role));
    if (creds.status != 200) {
      return HttpStatusError(creds.status, what + ": GET " + list + role, "");
    }
    CAIRN_ASSIGN_OR_RETURN(TimedCredentials t, ParseCredentialsJson(creds.body, what, false));
    t.source = "instance metadata";
    return std::optional<TimedCredentials>(std::move(t));
  }

 private:
  void SetAbsent(std::string why) {
    std::lock_guard<std::mutex> l(mu_);
    absent_ = Cut(why, 160);
  }
  std::shared_ptr<ProviderContext> ctx_;
  mutable std::mutex mu_;
  std::string absent_;  // why the last Load found no service
};

// ---- profiles ---------------------------------------------------------------------------

class ProfileProvider final : public CredentialProvider {
 public:
  explicit ProfileProvider(std::shared_ptr<ProviderContext> ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override {
    return "profile '" + ctx_->config.profile_name() + "' (AWS_CONFIG_FILE, " +
           "AWS_SHARED_CREDENTIALS_FILE)";
  }
  Result<std::optional<TimedCredentials>> Load() override {
    const std::string& profile = ctx_->config.profile_name();
    if (!ctx_->config.Profile(profile)) {
      if (profile == "default") return std::optional<TimedCredentials>();
      return NotFoundError("AWS profile '" + profile +
                           "' (AWS_PROFILE) is in neither the config nor the credentials file");
    }
    std::set<std::string> seen;
    return Resolve(profile, 0, &seen);
  }

 private:
  Result<std::optional<TimedCredentials>> Resolve(const std::string& name, int depth,
                                                  std::set<std::string>* seen) {
    const IniSection* p = ctx_->config.Profile(name);
    if (!p) return NotFoundError("AWS profile '" + name + "' not found");
    auto get = [p](const char* k) {
      auto it = p->find(k);
      return it == p->end() ? std::string() : it->second;
    };
    const std::string where = "profile '" + name + "'";
    auto static_keys = [&]() -> Result<std::optional<TimedCredentials>> {
      TimedCredentials t;
      t.creds = {get("aws_access_key_id"), get("aws_secret_access_key"), get("aws_session_token")};
      t.source = where;
      if (t.creds.access_key_id.empty() && t.creds.secret_access_key.empty()) {
        return std::optional<TimedCredentials>();
      }
      if (t.creds.access_key_id.empty() || t.creds.secret_access_key.empty()) {
        return InvalidArgumentError(where +
                                    ": partial credentials (aws_access_key_id and "
                                    "aws_secret_access_key must both be set)");
      }
      return std::optional<TimedCredentials>(std::move(t));
    };

    const std::string role_arn = get("role_arn");
    if (!role_arn.empty()) {
      if (depth >= kMaxProfileDepth || !seen->insert(name).second) {
        return InvalidArgumentError(where + ": source_profile chain loops or is deeper than " +
                                    std::to_string(kMaxProfileDepth));
      }
      std::string session = get("role_session_name");
      if (session.empty()) session = DefaultSessionName();
      const std::string source_profile = get("source_profile");
      const std::string credential_source = get("credential_source");
      const std::string token_file = get("web_identity_token_file");
      int given = !source_profile.empty() + !credential_source.empty() + !token_file.empty();
      if (given != 1) {
        return InvalidArgumentError(
            where +
            ": role_arn needs exactly one of source_profile, credential_source and "
            "web_identity_token_file");
      }
      if (!token_file.empty()) {
        CAIRN_ASSIGN_OR_RETURN(TimedCredentials t,
                               AssumeRoleWithWebIdentity(*ctx_, token_file, role_arn, session,
                                                         "profile web identity"));
        return std::optional<TimedCredentials>(std::move(t));
      }
      std::optional<TimedCredentials> source;
      if (!source_profile.empty()) {
        if (source_profile == name) {  // a role whose source is its own static keys
          CAIRN_ASSIGN_OR_RETURN(source, static_keys());
        } else {
          CAIRN_ASSIGN_OR_RETURN(source, Resolve(source_profile, depth + 1, seen));
        }
        if (!source) {
          return InvalidArgumentError(where + ": source_profile '" + source_profile +
                                      "' has no credentials");
        }
      } else {
        std::unique_ptr<CredentialProvider> from;
        if (credential_source == "Environment") {
          from = NewEnvProvider(ctx_);
        } else if (credential_source == "Ec2InstanceMetadata") {
          from = NewInstanceMetadataProvider(ctx_);
        } else if (credential_source == "EcsContainer") {
          from = NewContainerProvider(ctx_);
        } else {
          return InvalidArgumentError(where + ": credential_source '" + Cut(credential_source, 40) +
                                      "' is not Environment, Ec2InstanceMetadata or EcsContainer");
        }
        CAIRN_ASSIGN_OR_RETURN(source, from->Load());
        if (!source) {
          return InvalidArgumentError(where + ": credential_source " + credential_source +
                                      " has no credentials");
        }
      }
      std::vector<std::pair<std::string, std::string>> params = {{"RoleArn", role_arn},
                                                                 {"RoleSessionName", session}};
      if (std::string d = get("duration_seconds"); !d.empty())
        params.emplace_back("DurationSeconds", d);
      if (std::string e = get("external_id"); !e.empty()) params.emplace_back("ExternalId", e);
      CAIRN_ASSIGN_OR_RETURN(TimedCredentials t, CallSts(*ctx_, "AssumeRole", std::move(params),
                                                         &source->creds, where + " role_arn"));
      return std::optional<TimedCredentials>(std::move(t));
    }

    CAIRN_ASSIGN_OR_RETURN(std::optional<TimedCredentials> keys, static_keys());
    if (keys) return keys;
    const std::string process = get("credential_process");
    if (!process.empty()) {
      auto out = RunCredentialProcess(process);
      if (!out.ok()) return out.status().WithContext(where);
      CAIRN_ASSIGN_OR_RETURN(TimedCredentials t,
                             ParseCredentialsJson(*out, where + ": credential_process", true));
      t.source = where + " credential_process";
      return std::optional<TimedCredentials>(std::move(t));
    }
    return std::optional<TimedCredentials>();
  }

  std::shared_ptr<ProviderContext> ctx_;
};

}  // namespace

// ---- parsers ---------------------------------------------------------------------------

std::optional<WallClock::time_point> ParseIso8601(const std::string& s) {
  if (s.size() > 64) return std::nullopt;
  std::tm tm{};
  const char* p = strptime(s.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  if (!p) return std::nullopt;
  if (*p == '.') {
    ++p;
    while (std::isdigit(static_cast<unsigned char>(*p))) ++p;
  }
  long offset = 0;
  if (*p == 'Z' || *p == 'z') {
    ++p;
  } else if (*p == '+' || *p == '-') {
    int hh = 0, mm = 0;
    int n = 0;
    if (std::sscanf(p + 1, "%2d:%2d%n", &hh, &mm, &n) != 2 || n != 5) return std::nullopt;
    offset = (hh * 3600L + mm * 60L) * (*p == '-' ? -1 : 1);
    p += 1 + n;
  } else {
    return std::nullopt;
  }
  if (*p != '\0') return std::nullopt;
  time_t t = timegm(&tm);
  if (t == static_cast<time_t>(-1)) return std::nullopt;
  return WallClock::from_time_t(t - offset);
}

Result<TimedCredentials> ParseCredentialsJson(const std::string& body, const std::string& what,
                                              bool process_format) {
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return UnavailableError(what + ": the answer is not a JSON object");
  }
  auto str = [&](const char* k) -> std::string {
    auto it = j.find(k);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  if (process_format) {
    auto v = j.find("Version");
    if (v == j.end() || !v->is_number_integer() || v->get<long long>() != 1) {
      return InvalidArgumentError(what + ": output lacks \"Version\": 1");
    }
  } else if (j.contains("Code") && str("Code") != "Success") {
    return UnavailableError(what + ": Code '" + Cut(str("Code"), 64) + "'");
  }
  TimedCredentials t;
  t.creds = {str("AccessKeyId"), str("SecretAccessKey"),
             str(process_format ? "SessionToken" : "Token")};
  if (t.creds.access_key_id.empty() || t.creds.secret_access_key.empty()) {
    return UnavailableError(what + ": the answer lacks AccessKeyId or SecretAccessKey");
  }
  if (std::string e = str("Expiration"); !e.empty()) {
    t.expiration = ParseIso8601(e);
    if (!t.expiration) {
      return UnavailableError(what + ": Expiration '" + Cut(e, 40) + "' is not an ISO 8601 time");
    }
  }
  return t;
}

Result<TimedCredentials> ParseStsResponse(const std::string& body, const std::string& action) {
  pugi::xml_document doc;
  pugi::xml_node c;
  if (!doc.load_buffer(body.data(), body.size()) || !(c = doc.child((action + "Response").c_str())
                                                              .child((action + "Result").c_str())
                                                              .child("Credentials"))) {
    return UnavailableError("malformed response (no " + action + "Result/Credentials)");
  }
  TimedCredentials t;
  t.creds = {Trim(c.child_value("AccessKeyId")), Trim(c.child_value("SecretAccessKey")),
             Trim(c.child_value("SessionToken"))};
  if (t.creds.access_key_id.empty() || t.creds.secret_access_key.empty() ||
      t.creds.session_token.empty()) {
    return UnavailableError("malformed response (credentials incomplete)");
  }
  std::string e = Trim(c.child_value("Expiration"));
  t.expiration = ParseIso8601(e);
  if (!t.expiration) {
    return UnavailableError("malformed response (Expiration '" + Cut(e, 40) + "')");
  }
  return t;
}

Result<std::string> ContainerCredentialsUrl(const EnvLookup& env) {
  std::string rel = env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
  if (!rel.empty()) {
    if (rel[0] != '/' || rel.find_first_of("\r\n ") != std::string::npos) {
      return InvalidArgumentError("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI must be a path");
    }
    return "http://169.254.170.2" + rel;
  }
  std::string full = env("AWS_CONTAINER_CREDENTIALS_FULL_URI");
  if (full.empty()) return std::string();
  if (full.find_first_of("\r\n ") != std::string::npos) {
    return InvalidArgumentError("AWS_CONTAINER_CREDENTIALS_FULL_URI is not a URL");
  }
  std::string lower = Lower(full);
  if (lower.rfind("https://", 0) == 0) return full;
  if (lower.rfind("http://", 0) == 0) {
    std::string path;
    if (AllowedHttpHost(HostOf(full, &path))) return full;
  }
  return InvalidArgumentError("AWS_CONTAINER_CREDENTIALS_FULL_URI '" + Cut(full, 100) +
                              "': http is allowed only to loopback, 169.254.170.2 (ECS) and "
                              "169.254.170.23 (EKS Pod Identity); use https");
}

// ---- the chain -----------------------------------------------------------------------

Result<std::optional<TimedCredentials>> ProviderChain::Load() {
  std::string tried;
  for (auto& p : providers_) {
    auto r = p->Load();
    if (!r.ok()) return r.status();
    if (*r) return r;
    if (!tried.empty()) tried += "; ";
    tried += p->name();
  }
  return FailedPreconditionError("no AWS credentials found; tried: " + tried);
}

std::unique_ptr<CredentialProvider> NewEnvProvider(std::shared_ptr<ProviderContext> ctx) {
  return std::make_unique<EnvProvider>(std::move(ctx));
}
std::unique_ptr<CredentialProvider> NewWebIdentityProvider(std::shared_ptr<ProviderContext> ctx) {
  return std::make_unique<WebIdentityProvider>(std::move(ctx));
}
std::unique_ptr<CredentialProvider> NewProfileProvider(std::shared_ptr<ProviderContext> ctx) {
  return std::make_unique<ProfileProvider>(std::move(ctx));
}
std::unique_ptr<CredentialProvider> NewContainerProvider(std::shared_ptr<ProviderContext> ctx) {
  return std::make_unique<ContainerProvider>(std::move(ctx));
}
std::unique_ptr<CredentialProvider> NewInstanceMetadataProvider(
    std::shared_ptr<ProviderContext> ctx) {
  return std::make_unique<InstanceMetadataProvider>(std::move(ctx));
}

std::unique_ptr<CredentialProvider> DefaultProviderChain(std::shared_ptr<ProviderContext> ctx) {
  std::vector<std::unique_ptr<CredentialProvider>> v;
  v.push_back(NewEnvProvider(ctx));
  v.push_back(NewWebIdentityProvider(ctx));
  v.push_back(NewProfileProvider(ctx));
  v.push_back(NewContainerProvider(ctx));
  v.push_back(NewInstanceMetadataProvider(ctx));
  return std::make_unique<ProviderChain>(std::move(v));
}

// ---- refreshing ----------------------------------------------------------------------

RefreshWindows RefreshWindowsFromEnv(const EnvLookup& env) {
  RefreshWindows w;
  auto num = [&](const char* name, double dflt) {
    std::string v = env(name);
    if (v.empty()) return dflt;
    char* end = nullptr;
    double d = std::strtod(v.c_str(), &end);
    return end && *end == '\0' && d >= 0 ? d : dflt;
  };
  w.advisory_s = num("CAIRN_S3_CREDENTIALS_ADVISORY_S", w.advisory_s);
  w.mandatory_s = std::min(w.advisory_s, num("CAIRN_S3_CREDENTIALS_MANDATORY_S", w.mandatory_s));
  return w;
}

RefreshingCredentials::RefreshingCredentials(std::unique_ptr<CredentialProvider> provider,
                                             RefreshWindows windows)
    : provider_(std::move(provider)), windows_(windows) {}

RefreshingCredentials::~RefreshingCredentials() {
  std::thread t;
  {
    std::lock_guard<std::mutex> l(mu_);
    t = std::move(background_);
  }
  if (t.joinable()) t.join();
}

int RefreshingCredentials::refreshes() const {
  std::lock_guard<std::mutex> l(mu_);
  return refreshes_;
}

// Called with loading_ set by the caller and `l` held; loads with the lock
// released, stores the outcome.
Status RefreshingCredentials::LoadLocked(std::unique_lock<std::mutex>& l) {
  l.unlock();
  auto r = provider_->Load();
  l.lock();
  loading_ = false;
  last_load_ = WallClock::now();
  Status s = r.status();
  if (r.ok() && !*r) s = FailedPreconditionError("no AWS credentials found");
  if (s.ok()) {
    current_ = std::move(**r);
    ++refreshes_;
  }
  last_error_ = s;
  ++generation_;
  cv_.notify_all();
  return s;
}

void RefreshingCredentials::Background() {
  std::unique_lock<std::mutex> l(mu_);
  if (!LoadLocked(l).ok()) next_background_ = WallClock::now() + std::chrono::seconds(5);
}

Status RefreshingCredentials::Prime() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return !loading_; });
  loading_ = true;
  return LoadLocked(l);
}

Result<Credentials> RefreshingCredentials::Current() {
  using Secs = std::chrono::duration<double>;
  std::unique_lock<std::mutex> l(mu_);
  const auto now = WallClock::now();
  if (current_) {
    if (!current_->expiration) return current_->creds;
    const double left = Secs(*current_->expiration - now).count();
    if (left > windows_.advisory_s) return current_->creds;
    if (left > windows_.mandatory_s) {
      // Advisory: refresh behind the caller's back, keep signing with these.
      if (!loading_ && now >= next_background_) {
        loading_ = true;
        if (background_.joinable()) background_.join();  // done: it cleared loading_
        background_ = std::thread([this] { Background(); });
      }
      return current_->creds;
    }
    // Mandatory: refreshed less than a second ago and still valid (a source
    // that hands out short-lived credentials): use them rather than asking
    // again for every request.
    if (left > 0 && now - last_load_ < std::chrono::seconds(1)) return current_->creds;
  }
  if (loading_) {
    // Someone else is refreshing: wait for that outcome, do not start another.
    const uint64_t gen = generation_;
    cv_.wait(l, [&] { return generation_ != gen; });
  } else {
    loading_ = true;
    LoadLocked(l).IgnoreError();
  }
  const auto after = WallClock::now();
  if (current_ && (!current_->expiration || *current_->expiration > after)) {
    return current_->creds;  // fresh, or a failed refresh of still-valid ones
  }
  if (!last_error_.ok()) return last_error_;
  return PermissionDeniedError("the AWS credentials from " +
                               (current_ ? current_->source : std::string("the chain")) +
                               " have expired and the refresh returned expired ones");
}

// ---- sharing ----------------------------------------------------------------------------

std::string ProcessCredentialFingerprint(const std::string& extra) {
  std::vector<std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    if (kv.rfind("AWS_", 0) == 0 || kv.rfind("CAIRN_S3_", 0) == 0) vars.emplace_back(kv);
  }
  std::sort(vars.begin(), vars.end());
  std::string all = extra;
  for (const auto& v : vars) all += '\0' + v;
  const char* home = std::getenv("HOME");
  auto file = [&](const char* var, const char* dflt) {
    const char* p = std::getenv(var);
    std::string path = p && *p ? p : (home ? std::string(home) + dflt : std::string());
    struct stat st {};
    all += '\0' + path;
    if (!path.empty() && ::stat(path.c_str(), &st) == 0) {
      all += ':' + std::to_string(st.st_size) + ':' + std::to_string(st.st_mtim.tv_sec) + '.' +
             std::to_string(st.st_mtim.tv_nsec) + ':' + std::to_string(st.st_ino);
    }
  };
  file("AWS_CONFIG_FILE", "/.aws/config");
  file("AWS_SHARED_CREDENTIALS_FILE", "/.aws/credentials");
  return Sha256Hex(all.data(), all.size());
}

Result<std::shared_ptr<RefreshingCredentials>> SharedCredentials(
    const std::string& fingerprint,
    const std::function<std::shared_ptr<RefreshingCredentials>()>& make) {
  // Never destroyed: a background refresh may still run at exit.
  static auto* mu = new std::mutex;
  static auto* cache =
      new std::deque<std::pair<std::string, std::shared_ptr<RefreshingCredentials>>>;
  constexpr size_t kMaxEntries = 16;
  std::shared_ptr<RefreshingCredentials> found;
  {
    std::lock_guard<std::mutex> l(*mu);
    for (auto& [k, v] : *cache) {
      if (k == fingerprint) found = v;
    }
  }
  if (found && found->Current().ok()) return found;
  // New (or broken): load outside the lock, so one slow source does not hold
  // up storages of other configurations.
  std::shared_ptr<RefreshingCredentials> fresh = make();
  CAIRN_RETURN_IF_ERROR(fresh->Prime());
  std::lock_guard<std::mutex> l(*mu);
  for (auto it = cache->begin(); it != cache->end(); ++it) {
    if (it->first == fingerprint) {
      cache->erase(it);
      break;
    }
  }
  cache->emplace_back(fingerprint, fresh);
  if (cache->size() > kMaxEntries) cache->pop_front();
  return fresh;
}

}  // namespace cairn::s3
