// The AWS shared config and credentials files, and the settings of the s3
// backend resolved from them and the environment (internal to the s3
// backend).
//
// Files, as botocore reads them:
//   AWS_CONFIG_FILE (else ~/.aws/config):  [default], [profile NAME],
//       [services NAME]; a key with an empty value opens a nested block of
//       indented "key = value" lines ("s3 =\n  addressing_style = path"),
//       kept here as the flat key "s3.addressing_style".
//   AWS_SHARED_CREDENTIALS_FILE (else ~/.aws/credentials):  [NAME].
//   A profile's keys are the union of both files' sections; where both set a
//   key, the credentials file wins (as in botocore).
//   The profile is AWS_PROFILE, else AWS_DEFAULT_PROFILE, else "default".
//
// Settings of the s3 backend, first found wins (see docs/storage.md):
//   region      AWS_REGION, AWS_DEFAULT_REGION, profile region, "us-east-1"
//   endpoint    AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's
//               `services` section's s3.endpoint_url, the profile's
//               endpoint_url (none of them with
//               AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true)
//   addressing  the profile's s3.addressing_style (auto, virtual, path)
//   ca_bundle   AWS_CA_BUNDLE, the profile's ca_bundle
//
// Everything here is plain data: thread-compatible, no I/O after Load().
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "cairn/status.h"

namespace cairn::s3 {

// Reads an environment variable; "" when unset. Tests pass their own.
using EnvLookup = std::function<std::string(const char* name)>;
EnvLookup ProcessEnv();

using IniSection = std::map<std::string, std::string>;
using IniSections = std::map<std::string, IniSection>;

// Parses the text of an AWS config or credentials file into sections (names
// as written between the brackets, trimmed). Comments (#, ;), blank lines and
// nested blocks as above. A line that is neither a section, a key = value nor
// a comment is an error naming `origin` and the line number (never the
// line: a credentials file holds secrets).
Result<IniSections> ParseIni(std::string_view text, const std::string& origin);

// The files as found for one process.
class AwsConfig {
 public:
  // Reads both files (a missing file is no error; an unreadable, malformed
  // or oversized (> 1 MiB) one is).
  static Result<AwsConfig> Load(const EnvLookup& env);
  // From texts (tests).
  static Result<AwsConfig> FromText(std::string_view config, std::string_view credentials,
                                    std::string profile);

  const std::string& profile_name() const { return profile_; }
  // The merged keys of profile `name` (see the top); nullptr if neither
  // file has it.
  const IniSection* Profile(const std::string& name) const;
  // A key of the active profile; "" when unset.
  std::string Get(const std::string& key) const;
  // [services NAME] of the config file; nullptr if absent.
  const IniSection* Services(const std::string& name) const;

 private:
  static AwsConfig Build(const IniSections& conf, const IniSections& cred, std::string profile);
  std::string profile_;
  std::map<std::string, IniSection> profiles_;
  std::map<std::string, IniSection> services_;
};

enum class AddressingStyle { kAuto, kVirtual, kPath };

// What the s3 backend takes from the environment and the files.
struct S3Settings {
  std::string region;
  std::string endpoint;  // "" = AWS
  AddressingStyle addressing = AddressingStyle::kAuto;
  std::string ca_bundle;
};
Result<S3Settings> ResolveS3Settings(const EnvLookup& env, const AwsConfig& config);

// The endpoint of another service (e.g. "sts") by the same rules as S3's:
// AWS_ENDPOINT_URL_<SERVICE>, AWS_ENDPOINT_URL, services, profile; else
// https://<service>.<region>.amazonaws.com.
std::string ServiceEndpoint(const EnvLookup& env, const AwsConfig& config,
                            const std::string& service, const std::string& region);

// Where requests for a bucket go.
struct S3Address {
  std::string base_url;    // "https://host[:port]" (no path)
  std::string host;        // the Host header ("host[:port]")
  std::string base_path;   // the endpoint's own path ("" or "/p")
  bool path_style = true;  // keys go to base_path/BUCKET/KEY, else base_path/KEY
};
// Virtual-hosted style (https://BUCKET.s3.REGION.amazonaws.com) for AWS when
// the bucket name can be a host name; path style for a custom endpoint, for
// names that cannot (dots under https, upper case, underscores), or when
// configured. kVirtual with such a name is an error.
Result<S3Address> ResolveS3Address(const std::string& endpoint, const std::string& region,
                                   const std::string& bucket, AddressingStyle style);

// True when `bucket` can be the first label of a host name ("my-bucket"; not
// "My_Bucket"; with a dot only over http, where no certificate must match).
bool DnsCompatibleBucket(const std::string& bucket, bool https);

}  // namespace cairn::s3
