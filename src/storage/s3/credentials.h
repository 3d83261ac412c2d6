// The AWS credential provider chain (internal to the s3 backend), shaped like
// botocore's credentials.py: one interface (CredentialProvider), one class
// per source, one ordered list (ProviderChain), and a cache that refreshes
// temporary credentials before they expire (RefreshingCredentials). The
// signer only ever asks CredentialSource::Current().
//
// The chain, in the order of the AWS SDKs (docs/storage.md compares it with
// boto3's):
//   1. EnvProvider            AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
//                             AWS_SESSION_TOKEN (+ AWS_CREDENTIAL_EXPIRATION)
//   2. WebIdentityProvider    AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN
//                             [+ AWS_ROLE_SESSION_NAME]: STS
//                             AssumeRoleWithWebIdentity (EKS IRSA)
//   3. ProfileProvider        the profile of the config and credentials files:
//                             role_arn (+ source_profile | credential_source |
//                             web_identity_token_file) through STS AssumeRole,
//                             else static keys, else credential_process
//   4. ContainerProvider      AWS_CONTAINER_CREDENTIALS_RELATIVE_URI (ECS) or
//                             _FULL_URI with AWS_CONTAINER_AUTHORIZATION_TOKEN
//                             (_FILE) (EKS Pod Identity)
//   5. InstanceMetadataProvider  IMDSv2: PUT /latest/api/token, then GET
//                             /latest/meta-data/iam/security-credentials/ROLE
//                             with the token (AWS_EC2_METADATA_SERVICE_ENDPOINT,
//                             AWS_EC2_METADATA_DISABLED)
// A provider whose source is not configured answers "not mine" (nullopt) and
// the chain asks the next; one that is configured but fails stops the chain
// with its error (a misconfigured role must not fall through to some other
// identity), except the instance metadata service, which is only "not mine"
// when it cannot be reached (not on EC2).
//
// Every answer from STS, IMDS, a container endpoint or a credential_process
// is untrusted: bodies are capped (64 KiB), requests have short timeouts, and
// errors quote at most a short, cut piece of a server's text. Secrets (keys,
// session tokens, web identity and authorization tokens) never enter an
// error message.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cairn/status.h"
#include "storage/s3/aws_config.h"
#include "storage/s3/http.h"
#include "storage/s3/sigv4.h"

namespace cairn::s3 {

using WallClock = std::chrono::system_clock;

// Credentials with the time they stop working (none: static keys).
struct TimedCredentials {
  Credentials creds;
  std::optional<WallClock::time_point> expiration;
  std::string source;  // which provider ("environment", "instance metadata", ...)
};

// One source of credentials. Load() may block on the network for a few
// seconds; implementations are thread-compatible (the chain and the cache
// never call one provider from two threads at once).
class CredentialProvider {
 public:
  virtual ~CredentialProvider() = default;
  virtual std::string name() const = 0;
  // Credentials; nullopt when this source is not configured here (the chain
  // goes on); an error when it is configured but failed.
  virtual Result<std::optional<TimedCredentials>> Load() = 0;
};

// What the providers share: the environment, the files, an HTTP client.
struct ProviderContext {
  EnvLookup env;
  AwsConfig config;
  std::string region;
  std::shared_ptr<HttpClient> http;
};

// The ordered list. Not configured anywhere: kFailedPrecondition naming
// every source tried.
class ProviderChain final : public CredentialProvider {
 public:
  explicit ProviderChain(std::vector<std::unique_ptr<CredentialProvider>> providers)
      : providers_(std::move(providers)) {}
  std::string name() const override { return "chain"; }
  Result<std::optional<TimedCredentials>> Load() override;

 private:
  std::vector<std::unique_ptr<CredentialProvider>> providers_;
};

// The default chain above.
std::unique_ptr<CredentialProvider> DefaultProviderChain(std::shared_ptr<ProviderContext> ctx);

// Individual providers (exposed for tests and for credential_source).
std::unique_ptr<CredentialProvider> NewEnvProvider(std::shared_ptr<ProviderContext> ctx);
std::unique_ptr<CredentialProvider> NewWebIdentityProvider(std::shared_ptr<ProviderContext> ctx);
std::unique_ptr<CredentialProvider> NewProfileProvider(std::shared_ptr<ProviderContext> ctx);
std::unique_ptr<CredentialProvider> NewContainerProvider(std::shared_ptr<ProviderContext> ctx);
std::unique_ptr<CredentialProvider> NewInstanceMetadataProvider(
    std::shared_ptr<ProviderContext> ctx);

// Parsers of the untrusted answers (exposed for tests).
// An ISO 8601 UTC time as AWS writes it ("2024-01-02T03:04:05Z", with
// optional fraction, "Z" or "+00:00").
std::optional<WallClock::time_point> ParseIso8601(const std::string& s);
// The JSON of the container endpoint, IMDS and credential_process.
Result<TimedCredentials> ParseCredentialsJson(const std::string& body, const std::string& what,
                                              bool process_format);
// An STS AssumeRole* response.
Result<TimedCredentials> ParseStsResponse(const std::string& body, const std::string& action);
// The URL of the container endpoint from the environment; "" when unset.
Result<std::string> ContainerCredentialsUrl(const EnvLookup& env);

// The signer's view: credentials usable now.
class CredentialSource {
 public:
  virtual ~CredentialSource() = default;
  virtual Result<Credentials> Current() = 0;
};

// Refresh windows before expiration (botocore's RefreshableCredentials):
// inside `advisory` a refresh starts in the background while the current
// credentials keep being used; inside `mandatory` callers wait for it.
// CAIRN_S3_CREDENTIALS_ADVISORY_S / CAIRN_S3_CREDENTIALS_MANDATORY_S.
struct RefreshWindows {
  double advisory_s = 15 * 60;
  double mandatory_s = 10 * 60;
};
RefreshWindows RefreshWindowsFromEnv(const EnvLookup& env);

// A CredentialSource over a provider: caches what it returned, refreshes it
// as above (one refresh at a time, at most one background thread, joined by
// the destructor). A failed background refresh is retried no sooner than 5 s
// later; a failed mandatory refresh keeps using credentials that have not
// yet expired, and is an error only once they have. Thread-safe. Owns the
// provider.
class RefreshingCredentials final : public CredentialSource {
 public:
  RefreshingCredentials(std::unique_ptr<CredentialProvider> provider, RefreshWindows windows);
  ~RefreshingCredentials() override;
  // Loads the first credentials (NewS3Storage calls it once, so that a
  // missing identity fails at open).
  Status Prime();
  Result<Credentials> Current() override;
  // Refreshes done so far (tests).
  int refreshes() const;

 private:
  Status LoadLocked(std::unique_lock<std::mutex>& l);
  void Background();

  std::unique_ptr<CredentialProvider> provider_;
  const RefreshWindows windows_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<TimedCredentials> current_;
  bool loading_ = false;     // a Load() is running (in a caller or the background)
  uint64_t generation_ = 0;  // Load()s finished
  Status last_error_;        // of the last Load()
  WallClock::time_point last_load_{};
  int refreshes_ = 0;
  WallClock::time_point next_background_{};
  std::thread background_;
};

// The credentials of one configuration, shared by every storage opened with
// it in this process, so that opening many storages (every save, load and
// listing opens one) asks STS or the metadata service once, not per open.
// The configuration is `fingerprint` (see ProcessCredentialFingerprint); a
// new entry is made with `make` and kept only once its first load succeeded;
// an entry whose credentials can no longer be had is replaced. At most 16
// entries, the oldest dropped. Thread-safe.
Result<std::shared_ptr<RefreshingCredentials>> SharedCredentials(
    const std::string& fingerprint,
    const std::function<std::shared_ptr<RefreshingCredentials>()>& make);

// SHA-256 over everything the chain reads: every AWS_* and CAIRN_S3_*
// variable of the process (values included: changed keys are a new
// configuration), the config and credentials files' paths, sizes and
// modification times, and `extra` (region, CA bundle).
std::string ProcessCredentialFingerprint(const std::string& extra);

}  // namespace cairn::s3
