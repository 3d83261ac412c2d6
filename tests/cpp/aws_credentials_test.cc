// The AWS config files, the s3 backend's addressing, the order of the
// credential chain and the refresh of temporary credentials, without a
// server (tests/python/test_s3_credentials.py runs every provider against
// real local servers).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <thread>

#include "storage/s3/aws_config.h"
#include "storage/s3/credentials.h"

namespace cairn::s3 {
namespace {

using namespace std::chrono_literals;

EnvLookup MapEnv(std::map<std::string, std::string> m) {
  return [m = std::move(m)](const char* name) {
    auto it = m.find(name);
    return it == m.end() ? std::string() : it->second;
  };
}

TEST(AwsConfig, ProfilesServicesAndNestedKeys) {
  const char* config = R"(
# comment
[default]
region = eu-west-1
[profile ckpt]
region = us-west-2   ; inline comment
services = local
s3 =
  addressing_style = path
  other = x
ca_bundle = /etc/ca.pem
[services local]
s3 =
  endpoint_url = http://127.0.0.1:9000
[ckpt]
region = ignored-bare-section-in-config
)";
  const char* creds = "[ckpt]\naws_access_key_id = AK\naws_secret_access_key = SK\n";
  auto c = AwsConfig::FromText(config, creds, "ckpt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->Get("region"), "us-west-2");
  EXPECT_EQ(c->Get("s3.addressing_style"), "path");
  EXPECT_EQ(c->Get("s3.other"), "x");
  EXPECT_EQ(c->Get("ca_bundle"), "/etc/ca.pem");  // the nested block ended
  EXPECT_EQ(c->Get("aws_access_key_id"), "AK");
  ASSERT_NE(c->Services("local"), nullptr);
  auto s = ResolveS3Settings(MapEnv({}), *c);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->region, "us-west-2");
  EXPECT_EQ(s->endpoint, "http://127.0.0.1:9000");
  EXPECT_EQ(s->addressing, AddressingStyle::kPath);
  EXPECT_EQ(s->ca_bundle, "/etc/ca.pem");
  // The environment wins over the files.
  s = ResolveS3Settings(MapEnv({{"AWS_REGION", "ap-south-1"},
                                {"AWS_ENDPOINT_URL_S3", "https://s3.example"},
                                {"AWS_CA_BUNDLE", "/other.pem"}}),
                        *c);
  EXPECT_EQ(s->region, "ap-south-1");
  EXPECT_EQ(s->endpoint, "https://s3.example");
  EXPECT_EQ(s->ca_bundle, "/other.pem");
  s = ResolveS3Settings(MapEnv({{"AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true"}}), *c);
  EXPECT_EQ(s->endpoint, "");
  EXPECT_EQ(ServiceEndpoint(MapEnv({}), *c, "sts", "us-west-2"),
            "https://sts.us-west-2.amazonaws.com");
}

TEST(AwsConfig, CredentialsFileWinsAndMissingProfileHasNoKeys) {
  auto c = AwsConfig::FromText("[default]\naws_access_key_id = FROMCONFIG\n",
                               "[default]\naws_access_key_id = FROMCREDS\n", "default");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->Get("aws_access_key_id"), "FROMCREDS");
  EXPECT_EQ(c->Profile("nope"), nullptr);
}

TEST(AwsConfig, MalformedLineIsAnErrorWithoutItsText) {
  auto c = AwsConfig::FromText("", "[default]\nAKIASECRETLINE\n", "default");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("line 2"), std::string::npos) << c.status().ToString();
  EXPECT_EQ(c.status().message().find("AKIASECRETLINE"), std::string::npos);
  EXPECT_FALSE(AwsConfig::FromText("key = outside\n", "", "default").ok());
  auto bad = AwsConfig::FromText("[default]\ns3 =\n  addressing_style = sideways\n", "", "default");
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(ResolveS3Settings(MapEnv({}), *bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(AwsAddressing, VirtualOnAwsPathWhereRequiredOrConfigured) {
  auto a = ResolveS3Address("", "eu-west-1", "my-bucket", AddressingStyle::kAuto);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->path_style);
  EXPECT_EQ(a->base_url, "https://my-bucket.s3.eu-west-1.amazonaws.com");
  EXPECT_EQ(a->host, "my-bucket.s3.eu-west-1.amazonaws.com");
  // Names that cannot be a host under the wildcard certificate: path style.
  for (const char* b : {"my.bucket", "My_Bucket", "UPPER", "ab"}) {
    a = ResolveS3Address("", "eu-west-1", b, AddressingStyle::kAuto);
    ASSERT_TRUE(a.ok());
    EXPECT_TRUE(a->path_style) << b;
    EXPECT_EQ(a->host, "s3.eu-west-1.amazonaws.com");
  }
  a = ResolveS3Address("", "eu-west-1", "my-bucket", AddressingStyle::kPath);
  EXPECT_TRUE(a->path_style);
  // A custom endpoint: path style unless configured virtual.
  a = ResolveS3Address("http://127.0.0.1:9000/base/", "us-east-1", "b1x", AddressingStyle::kAuto);
  EXPECT_TRUE(a->path_style);
  EXPECT_EQ(a->base_url, "http://127.0.0.1:9000");
  EXPECT_EQ(a->base_path, "/base");
  a = ResolveS3Address("http://localhost:9000", "us-east-1", "b1x", AddressingStyle::kVirtual);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->path_style);
  EXPECT_EQ(a->base_url, "http://b1x.localhost:9000");
  EXPECT_EQ(
      ResolveS3Address("", "us-east-1", "My_Bucket", AddressingStyle::kVirtual).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_FALSE(ResolveS3Address("127.0.0.1:9000", "us-east-1", "b", AddressingStyle::kAuto).ok());
}

TEST(CredentialParsers, Iso8601AndUntrustedJson) {
  auto t = ParseIso8601("2030-01-02T03:04:05Z");
  ASSERT_TRUE(t);
  EXPECT_EQ(WallClock::to_time_t(*t), 1893553445);
  EXPECT_EQ(ParseIso8601("2030-01-02T03:04:05.123Z"), t);
  EXPECT_EQ(ParseIso8601("2030-01-02T04:04:05+01:00"), t);
  EXPECT_FALSE(ParseIso8601("2030-01-02 03:04:05"));
  EXPECT_FALSE(ParseIso8601("2030-01-02T03:04:05Zjunk"));
  auto c = ParseCredentialsJson(
      R"({"Code":"Success","AccessKeyId":"A","SecretAccessKey":"S","Token":"T",)"
      R"("Expiration":"2030-01-02T03:04:05Z"})",
      "imds", false);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->creds.session_token, "T");
  EXPECT_EQ(c->expiration, t);
  EXPECT_FALSE(ParseCredentialsJson("[1,2]", "x", false).ok());
  EXPECT_FALSE(ParseCredentialsJson(R"({"AccessKeyId":"A"})", "x", false).ok());
  auto bad = ParseCredentialsJson(
      R"({"Code":"Failure","AccessKeyId":"A","SecretAccessKey":"HIDE"})", "x", false);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message().find("HIDE"), std::string::npos);
  // credential_process: Version 1 and SessionToken.
  EXPECT_FALSE(
      ParseCredentialsJson(R"({"AccessKeyId":"A","SecretAccessKey":"S"})", "p", true).ok());
  c = ParseCredentialsJson(
      R"({"Version":1,"AccessKeyId":"A","SecretAccessKey":"S","SessionToken":"T"})", "p", true);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->creds.session_token, "T");
  EXPECT_FALSE(c->expiration);
}

TEST(CredentialParsers, ContainerUrlAllowsHttpOnlyToLinkLocalAndLoopback) {
  EXPECT_EQ(*ContainerCredentialsUrl(MapEnv({{"AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/x"}})),
            "http://169.254.170.2/v2/x");
  EXPECT_EQ(*ContainerCredentialsUrl(MapEnv({})), "");
  for (const char* ok : {"http://169.254.170.23/v1/credentials", "http://127.0.0.1:8080/c",
                         "http://localhost/c", "https://creds.example.com/c"}) {
    auto u = ContainerCredentialsUrl(MapEnv({{"AWS_CONTAINER_CREDENTIALS_FULL_URI", ok}}));
    ASSERT_TRUE(u.ok()) << ok;
    EXPECT_EQ(*u, ok);
  }
  for (const char* bad : {"http://evil.example.com/c", "http://10.0.0.1/c", "ftp://127.0.0.1/"}) {
    EXPECT_FALSE(
        ContainerCredentialsUrl(MapEnv({{"AWS_CONTAINER_CREDENTIALS_FULL_URI", bad}})).ok())
        << bad;
  }
}

std::shared_ptr<ProviderContext> Context(std::map<std::string, std::string> env,
                                         std::string config = "", std::string creds = "") {
  auto e = MapEnv(env);
  std::string profile = env.count("AWS_PROFILE") ? env["AWS_PROFILE"] : "default";
  auto c = AwsConfig::FromText(config, creds, profile);
  EXPECT_TRUE(c.ok());
  return std::make_shared<ProviderContext>(
      ProviderContext{e, *c, "us-east-1", std::make_shared<HttpClient>()});
}

TEST(CredentialChain, EnvironmentThenProfileThenNothing) {
  const std::string creds =
      "[default]\naws_access_key_id = PROFILEKEY\naws_secret_access_key = S\n";
  auto r = DefaultProviderChain(Context({{"AWS_ACCESS_KEY_ID", "ENVKEY"},
                                         {"AWS_SECRET_ACCESS_KEY", "S"},
                                         {"AWS_EC2_METADATA_DISABLED", "true"}},
                                        "", creds))
               ->Load();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->creds.access_key_id, "ENVKEY");
  r = DefaultProviderChain(Context({{"AWS_EC2_METADATA_DISABLED", "true"}}, "", creds))->Load();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->creds.access_key_id, "PROFILEKEY");
  r = DefaultProviderChain(Context({{"AWS_EC2_METADATA_DISABLED", "true"}}))->Load();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  for (const char* source : {"environment", "web identity", "profile 'default'", "container",
                             "disabled by AWS_EC2_METADATA_DISABLED"}) {
    EXPECT_NE(r.status().message().find(source), std::string::npos) << r.status().ToString();
  }
}

TEST(CredentialChain, ConfiguredButFailingSourceStopsTheChain) {
  // Web identity configured against a closed port: the profile's keys after
  // it must not be used instead.
  const std::string creds =
      "[default]\naws_access_key_id = PROFILEKEY\naws_secret_access_key = S\n";
  auto r = DefaultProviderChain(Context({{"AWS_WEB_IDENTITY_TOKEN_FILE", "/nonexistent/token"},
                                         {"AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/r"}},
                                        "", creds))
               ->Load();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("web identity token file"), std::string::npos)
      << r.status().ToString();
  // Partial keys, a missing named profile, a source_profile loop.
  EXPECT_EQ(NewEnvProvider(Context({{"AWS_ACCESS_KEY_ID", "A"}}))->Load().status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(NewProfileProvider(Context({{"AWS_PROFILE", "absent"}}))->Load().status().code(),
            StatusCode::kNotFound);
  auto loop = NewProfileProvider(
                  Context({{"AWS_PROFILE", "a"}},
                          "[profile a]\nrole_arn = arn:aws:iam::1:role/a\nsource_profile = b\n"
                          "[profile b]\nrole_arn = arn:aws:iam::1:role/b\nsource_profile = a\n"))
                  ->Load();
  ASSERT_FALSE(loop.ok());
  EXPECT_NE(loop.status().message().find("loops"), std::string::npos) << loop.status().ToString();
}

// A provider that hands out numbered credentials expiring `ttl` after each
// load, taking `delay` per load; optionally failing.
class CountingProvider final : public CredentialProvider {
 public:
  CountingProvider(std::chrono::milliseconds ttl, std::chrono::milliseconds delay)
      : ttl_(ttl), delay_(delay) {}
  std::string name() const override { return "counting"; }
  Result<std::optional<TimedCredentials>> Load() override {
    std::this_thread::sleep_for(delay_);
    int n = ++loads;
    if (fail) return UnavailableError("refresh failed");
    TimedCredentials t;
    t.creds = {"KEY" + std::to_string(n), "S", "T"};
    t.expiration = WallClock::now() + ttl_;
    return std::optional<TimedCredentials>(t);
  }
  std::atomic<int> loads{0};
  std::atomic<bool> fail{false};

 private:
  std::chrono::milliseconds ttl_, delay_;
};

TEST(RefreshingCredentials, AdvisoryWindowRefreshesInTheBackground) {
  auto p = std::make_unique<CountingProvider>(3000ms, 400ms);
  CountingProvider* raw = p.get();
  RefreshingCredentials rc(std::move(p), RefreshWindows{2.5, 0.5});
  ASSERT_TRUE(rc.Prime().ok());
  EXPECT_EQ(rc.Current()->access_key_id, "KEY1");
  std::this_thread::sleep_for(700ms);  // inside the advisory window
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(rc.Current()->access_key_id, "KEY1");  // not waiting for the 400 ms load
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 200ms);
  std::this_thread::sleep_for(600ms);
  EXPECT_EQ(rc.Current()->access_key_id, "KEY2");
  EXPECT_EQ(raw->loads.load(), 2);
}

TEST(RefreshingCredentials, MandatoryWindowBlocksOnceForAllCallers) {
  auto p = std::make_unique<CountingProvider>(1000ms, 300ms);
  CountingProvider* raw = p.get();
  RefreshingCredentials rc(std::move(p), RefreshWindows{0.9, 0.9});
  ASSERT_TRUE(rc.Prime().ok());
  std::this_thread::sleep_for(1200ms);  // KEY1 expired
  std::vector<std::thread> ts;
  std::atomic<int> fresh{0};
  for (int i = 0; i < 8; ++i) {
    ts.emplace_back([&] {
      auto c = rc.Current();
      if (c.ok() && c->access_key_id == "KEY2") ++fresh;
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(fresh.load(), 8);
  EXPECT_EQ(raw->loads.load(), 2);
}

TEST(RefreshingCredentials, FailedRefreshKeepsValidCredentialsThenFails) {
  auto p = std::make_unique<CountingProvider>(1500ms, 0ms);
  CountingProvider* raw = p.get();
  RefreshingCredentials rc(std::move(p), RefreshWindows{1.2, 1.2});
  ASSERT_TRUE(rc.Prime().ok());
  raw->fail = true;
  std::this_thread::sleep_for(1100ms);  // mandatory window, still valid
  auto c = rc.Current();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->access_key_id, "KEY1");
  std::this_thread::sleep_for(600ms);  // expired
  c = rc.Current();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  raw->fail = false;
  c = rc.Current();
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->access_key_id, "KEY1");
}

}  // namespace
}  // namespace cairn::s3
