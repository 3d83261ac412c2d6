// AWS config files and the s3 backend's settings (see aws_config.h).
#include "storage/s3/aws_config.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace cairn::s3 {
namespace {

constexpr size_t kMaxConfigFileBytes = 1 << 20;

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Reads a whole file of at most kMaxConfigFileBytes; a missing file is "".
Result<std::string> ReadSmallFile(const std::string& path, bool* found) {
  *found = false;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT || errno == ENOTDIR) return std::string();
    return ErrnoToStatus(errno, "reading AWS file " + path);
  }
  *found = true;
  std::string text;
  char buf[8192];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxConfigFileBytes) {
      return InvalidArgumentError("AWS file " + path + " is larger than 1 MiB");
    }
  }
  return text;
}

std::string FromEnvOrProfile(const EnvLookup& env, const char* var, const AwsConfig& config,
                             const std::string& key) {
  std::string v = env(var);
  return v.empty() ? config.Get(key) : v;
}

bool IsTrue(const std::string& v) { return Lower(v) == "true"; }

}  // namespace

EnvLookup ProcessEnv() {
  return [](const char* name) {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
  };
}

Result<IniSections> ParseIni(std::string_view text, const std::string& origin) {
  IniSections out;
  std::string section;
  bool in_section = false;
  std::string nested;  // the key whose nested block is open
  size_t lineno = 0;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view raw = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    ++lineno;
    std::string_view line = Trim(raw);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    auto bad = [&](const char* what) {
      return InvalidArgumentError(origin + " line " + std::to_string(lineno) + ": " + what);
    };
    if (line.front() == '[') {
      if (line.back() != ']') return bad("unterminated section header");
      section = std::string(Trim(line.substr(1, line.size() - 2)));
      if (section.empty()) return bad("empty section name");
      out[section];
      in_section = true;
      nested.clear();
      continue;
    }
    size_t eq = line.find('=');
    if (eq == std::string_view::npos) return bad("expected key = value");
    if (!in_section) return bad("key outside any section");
    std::string key = Lower(Trim(line.substr(0, eq)));
    std::string value(Trim(line.substr(eq + 1)));
    // Strip an inline comment introduced by whitespace then # or ;.
    for (size_t i = 1; i < value.size(); ++i) {
      if ((value[i] == '#' || value[i] == ';') &&
          std::isspace(static_cast<unsigned char>(value[i - 1]))) {
        value = std::string(Trim(std::string_view(value).substr(0, i)));
        break;
      }
    }
    if (key.empty()) return bad("empty key");
    bool indented = !raw.empty() && (raw[0] == ' ' || raw[0] == '\t');
    if (indented && !nested.empty()) {
      out[section][nested + "." + key] = value;
      continue;
    }
    nested = value.empty() ? key : std::string();
    out[section][key] = value;
  }
  return out;
}

AwsConfig AwsConfig::Build(const IniSections& conf, const IniSections& cred, std::string profile) {
  AwsConfig c;
  c.profile_ = std::move(profile);
  for (const auto& [name, keys] : conf) {
    if (name == "default") {
      c.profiles_["default"].insert(keys.begin(), keys.end());
    } else if (name.rfind("profile ", 0) == 0) {
      // "[profile x]" (a bare "[x]" in the config file is ignored, as by
      // botocore, except for "default").
      std::string p(Trim(std::string_view(name).substr(8)));
      for (const auto& [k, v] : keys) c.profiles_[p][k] = v;
    } else if (name.rfind("services ", 0) == 0) {
      c.services_[std::string(Trim(std::string_view(name).substr(9)))] = keys;
    }
  }
  for (const auto& [name, keys] : cred) {
    for (const auto& [k, v] : keys) c.profiles_[name][k] = v;  // the credentials file wins
  }
  return c;
}

Result<AwsConfig> AwsConfig::FromText(std::string_view config, std::string_view credentials,
                                      std::string profile) {
  CAIRN_ASSIGN_OR_RETURN(IniSections conf, ParseIni(config, "AWS config file"));
  CAIRN_ASSIGN_OR_RETURN(IniSections cred, ParseIni(credentials, "AWS credentials file"));
  return Build(conf, cred, std::move(profile));
}

Result<AwsConfig> AwsConfig::Load(const EnvLookup& env) {
  std::string home = env("HOME");
  std::string config_path = env("AWS_CONFIG_FILE");
  if (config_path.empty() && !home.empty()) config_path = home + "/.aws/config";
  std::string cred_path = env("AWS_SHARED_CREDENTIALS_FILE");
  if (cred_path.empty() && !home.empty()) cred_path = home + "/.aws/credentials";
  std::string profile = env("AWS_PROFILE");
  if (profile.empty()) profile = env("AWS_DEFAULT_PROFILE");
  if (profile.empty()) profile = "default";
  std::string config, creds;
  bool found = false;
  if (!config_path.empty()) {
    CAIRN_ASSIGN_OR_RETURN(config, ReadSmallFile(config_path, &found));
  }
  if (!cred_path.empty()) {
    CAIRN_ASSIGN_OR_RETURN(creds, ReadSmallFile(cred_path, &found));
  }
  CAIRN_ASSIGN_OR_RETURN(IniSections conf, ParseIni(config, "AWS config file " + config_path));
  CAIRN_ASSIGN_OR_RETURN(IniSections cred, ParseIni(creds, "AWS credentials file " + cred_path));
  return Build(conf, cred, std::move(profile));
}

const IniSection* AwsConfig::Profile(const std::string& name) const {
  auto it = profiles_.find(name);
  return it == profiles_.end() ? nullptr : &it->second;
}

std::string AwsConfig::Get(const std::string& key) const {
  const IniSection* p = Profile(profile_);
  if (!p) return std::string();
  auto it = p->find(key);
  return it == p->end() ? std::string() : it->second;
}

const IniSection* AwsConfig::Services(const std::string& name) const {
  auto it = services_.find(name);
  return it == services_.end() ? nullptr : &it->second;
}

std::string ServiceEndpoint(const EnvLookup& env, const AwsConfig& config,
                            const std::string& service, const std::string& region) {
  if (!IsTrue(FromEnvOrProfile(env, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", config,
                               "ignore_configured_endpoint_urls"))) {
    std::string var = "AWS_ENDPOINT_URL_";
    for (char c : service) {
      var.push_back(c == '-' || c == ' '
                        ? '_'
                        : static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
    }
    std::string v = env(var.c_str());
    if (v.empty()) v = env("AWS_ENDPOINT_URL");
    if (v.empty()) {
      if (const IniSection* s = config.Services(config.Get("services"))) {
        auto it = s->find(service + ".endpoint_url");
        if (it != s->end()) v = it->second;
      }
    }
    if (v.empty()) v = config.Get("endpoint_url");
    if (!v.empty()) return v;
  }
  if (service == "s3") return std::string();
  return "https://" + service + "." + region + ".amazonaws.com";
}

Result<S3Settings> ResolveS3Settings(const EnvLookup& env, const AwsConfig& config) {
  S3Settings s;
  s.region = env("AWS_REGION");
  if (s.region.empty()) s.region = env("AWS_DEFAULT_REGION");
  if (s.region.empty()) s.region = config.Get("region");
  if (s.region.empty()) s.region = "us-east-1";
  s.endpoint = ServiceEndpoint(env, config, "s3", s.region);
  std::string style = Lower(config.Get("s3.addressing_style"));
  if (style.empty() || style == "auto") {
    s.addressing = AddressingStyle::kAuto;
  } else if (style == "virtual") {
    s.addressing = AddressingStyle::kVirtual;
  } else if (style == "path") {
    s.addressing = AddressingStyle::kPath;
  } else {
    return InvalidArgumentError("profile " + config.profile_name() + ": s3.addressing_style '" +
                                style.substr(0, 32) + "' is not auto, virtual or path");
  }
  s.ca_bundle = FromEnvOrProfile(env, "AWS_CA_BUNDLE", config, "ca_bundle");
  return s;
}

bool DnsCompatibleBucket(const std::string& b, bool https) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '.')) {
      return false;
    }
    if (c == '.' && https) return false;  // *.s3.amazonaws.com matches one label only
  }
  auto alnum = [](char c) {
    return std::islower(static_cast<unsigned char>(c)) ||
           std::isdigit(static_cast<unsigned char>(c));
  };
  return alnum(b.front()) && alnum(b.back()) && b.find("..") == std::string::npos;
}

Result<S3Address> ResolveS3Address(const std::string& endpoint, const std::string& region,
                                   const std::string& bucket, AddressingStyle style) {
  std::string ep = endpoint;
  while (!ep.empty() && ep.back() == '/') ep.pop_back();
  const bool aws = ep.empty();
  if (aws) ep = "https://s3." + region + ".amazonaws.com";
  size_t scheme = ep.find("://");
  if (scheme == std::string::npos) {
    return InvalidArgumentError("S3 endpoint '" + ep.substr(0, 200) +
                                "' has no scheme (http:// or https://)");
  }
  const std::string scheme_str = Lower(ep.substr(0, scheme));
  if (scheme_str != "http" && scheme_str != "https") {
    return InvalidArgumentError("S3 endpoint '" + ep.substr(0, 200) +
                                "': only http and https are supported");
  }
  size_t host_start = scheme + 3;
  size_t path_start = ep.find('/', host_start);
  S3Address a;
  a.host = ep.substr(host_start,
                     path_start == std::string::npos ? std::string::npos : path_start - host_start);
  if (a.host.empty()) return InvalidArgumentError("S3 endpoint '" + ep + "' has no host");
  a.base_path = path_start == std::string::npos ? "" : ep.substr(path_start);
  const bool https = scheme_str == "https";
  const bool dns_ok = DnsCompatibleBucket(bucket, https);
  switch (style) {
    case AddressingStyle::kPath:
      a.path_style = true;
      break;
    case AddressingStyle::kVirtual:
      if (!dns_ok) {
        return InvalidArgumentError("bucket '" + bucket +
                                    "' cannot be addressed virtual-hosted style (s3."
                                    "addressing_style = virtual): not a DNS-compatible name");
      }
      a.path_style = false;
      break;
    case AddressingStyle::kAuto:
      a.path_style = !(aws && dns_ok);
      break;
  }
  if (!a.path_style) a.host = bucket + "." + a.host;
  a.base_url = ep.substr(0, host_start) + a.host;
  return a;
}

}  // namespace cairn::s3
