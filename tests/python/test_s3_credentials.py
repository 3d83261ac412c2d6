"""The AWS credential provider chain and HTTPS, each against real local servers.

One moto server per module, auth on (every S3 request's SigV4 signature is
checked against the keys moto issued: IAM users' and STS sessions'), run
through tests/s3/moto_sts.py so that STS AssumeRoleWithWebIdentity is
answered unsigned as AWS does, against a known web identity token. The IMDSv2
and container endpoints are tests/s3/aws_endpoints.py subprocesses handing
out real STS sessions from that moto with a short Expiration; a forwarding
proxy from the same file serves TLS with a CA made here, and refuses requests
signed with keys past their Expiration (S3's ExpiredToken). The ECS
endpoint proper (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI) is served at
169.254.170.2:80, an address the test puts on the loopback interface (root
only) and removes afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn
import cairn.errors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]
S3_DIR = ROOT / "tests" / "s3"
sys.path.insert(0, str(S3_DIR))
from moto_server import REGION, MotoServer  # noqa: E402

ROLE_NAME = "cairn-ckpt-role"
ROLE_ARN = f"arn:aws:iam::123456789012:role/{ROLE_NAME}"
# A role (and a user) that may assume roles and nothing else: S3 refuses
# their own credentials, so a test passes only if the role_arn was assumed.
SOURCE_ROLE_NAME = "cairn-source-role"
SOURCE_ROLE_ARN = f"arn:aws:iam::123456789012:role/{SOURCE_ROLE_NAME}"


class _Moto(MotoServer):
    """moto with a role that may use S3 and an admin user that may assume it."""

    def _setup(self):
        import boto3
        s = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup",
                                  region_name=REGION)
        iam = s.client("iam", endpoint_url=self.endpoint)
        allow_all = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "*", "Resource": "*"}]})
        iam.create_role(RoleName=ROLE_NAME, AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]}))
        iam.put_role_policy(RoleName=ROLE_NAME, PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        assume_only = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}]})
        iam.create_role(RoleName=SOURCE_ROLE_NAME, AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]}))
        iam.put_role_policy(RoleName=SOURCE_ROLE_NAME, PolicyName="assume",
                            PolicyDocument=assume_only)
        iam.create_user(UserName="source")
        iam.put_user_policy(UserName="source", PolicyName="assume", PolicyDocument=assume_only)
        k = iam.create_access_key(UserName="source")["AccessKey"]
        self.source_key, self.source_secret = k["AccessKeyId"], k["SecretAccessKey"]
        iam.create_user(UserName="admin")
        iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=allow_all)
        k = iam.create_access_key(UserName="admin")["AccessKey"]
        self.admin_key, self.admin_secret = k["AccessKeyId"], k["SecretAccessKey"]
        super()._setup()  # the s3-only user "cairn", the bucket, then auth on


@pytest.fixture(scope="module")
def moto_sts():
    token = "eyJ" + secrets.token_urlsafe(40)  # the EKS-projected JWT stand-in
    os.environ["CAIRN_TEST_WEB_IDENTITY_TOKEN"] = token
    try:
        srv = _Moto(auth=True, script="moto_sts.py").start()
    finally:
        del os.environ["CAIRN_TEST_WEB_IDENTITY_TOKEN"]
    srv.web_identity_token = token
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def aws(moto_sts, monkeypatch, tmp_path):
    """A clean AWS environment: no keys, no ~/.aws, no IMDS; the moto endpoint.
    Returns (moto server, s3:// root of a fresh prefix, tmp dir)."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "CAIRN_S3_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws of the machine
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_sts.endpoint)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("CAIRN_S3_PART_SIZE", str(5 << 20))
    monkeypatch.setenv("CAIRN_S3_RETRY_DEADLINE_S", "20")
    return moto_sts, f"s3://{moto_sts.bucket}/c-{uuid.uuid4().hex[:10]}", tmp_path


class _Proc:
    """A tests/s3/aws_endpoints.py server in its own process group."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, str(S3_DIR / "aws_endpoints.py"), *args],
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError("aws_endpoints.py did not start")
        self.port = int(line)

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _metadata(srv, log, ttl=3600, auth_token="", hostile="", role_arn=ROLE_ARN,
              host="127.0.0.1", port=0):
    return _Proc("metadata", "--moto", srv.endpoint, "--key", srv.admin_key, "--secret",
                 srv.admin_secret, "--role-arn", role_arn, "--ttl", str(ttl), "--auth-token",
                 auth_token, "--log", str(log), "--hostile", hostile, "--host", host,
                 "--port", str(port))


@contextlib.contextmanager
def _address_on_loopback(addr):
    """`addr`/32 on the loopback interface for the block, removed afterwards
    (unless it was there before). Needs root; processes that do this take
    turns (an flock on the interface's sysfs directory, which leaves no
    file behind), so one never removes it under another."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip(f"putting {addr} on lo needs root and iproute2's ip (the ECS endpoint's "
                    "address; CI runs as root)")
    lock = os.open("/sys/class/net/lo", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shown = subprocess.run(["ip", "-4", "addr", "show", "dev", "lo"], capture_output=True,
                               text=True, check=True).stdout
        added = f"inet {addr}/" not in shown
        if added:
            r = subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", "lo"],
                               capture_output=True, text=True)
            assert r.returncode == 0, f"ip addr add {addr}/32 dev lo: {r.stderr.strip()}"
        try:
            yield
        finally:
            if added:
                subprocess.run(["ip", "addr", "del", f"{addr}/32", "dev", "lo"],
                               capture_output=True, check=False)
    finally:
        os.close(lock)  # releases the lock


def _records(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _state(seed, mib=1):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn((mib << 20) // 4, generator=g), "step": torch.tensor(seed)}


def _roundtrip(uri, seed=1, mib=1):
    ref = _state(seed, mib)
    dcp.save(ref, storage_writer=cairn.Writer(uri))
    out = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(out, storage_reader=cairn.Reader(uri))
    for k in ref:
        assert torch.equal(out[k], ref[k]), k


# ---- web identity (EKS IRSA) ------------------------------------------------------


def test_web_identity_assumes_the_role_through_sts(aws, monkeypatch):
    srv, root, tmp = aws
    token_file = tmp / "token"
    token_file.write_text(srv.web_identity_token + "\n")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("AWS_ROLE_ARN", ROLE_ARN)
    monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "irsa-test")
    _roundtrip(root + "/step_1")
    assert cairn.latest_valid(root) == root + "/step_1"
    # A token the identity provider did not issue: STS refuses, cairn says so
    # without quoting the token.
    bad = "eyJ" + secrets.token_urlsafe(40)
    (tmp / "token-bad").write_text(bad)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp / "token-bad"))
    with pytest.raises(cairn.errors.PermissionDeniedError) as e:
        cairn.latest_valid(root)
    assert "InvalidIdentityToken" in str(e.value) and bad not in str(e.value)
    # Static keys in the environment come first in the chain.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret)
    assert cairn.latest_valid(root) == root + "/step_1"


def test_a_profiles_web_identity_token_file_assumes_its_role(aws, monkeypatch):
    srv, root, tmp = aws
    (tmp / "token").write_text(srv.web_identity_token)
    config = tmp / "config"
    config.write_text(f"[profile irsa]\nrole_arn = {ROLE_ARN}\n"
                      f"web_identity_token_file = {tmp / 'token'}\nrole_session_name = prof\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "irsa")
    _roundtrip(root + "/step_1")  # nothing else could sign: no keys anywhere
    # A token the identity provider did not issue: STS refuses.
    bad = "eyJ" + secrets.token_urlsafe(40)
    (tmp / "token-bad").write_text(bad)
    config.write_text(f"[profile irsa]\nrole_arn = {ROLE_ARN}\n"
                      f"web_identity_token_file = {tmp / 'token-bad'}\n")
    with pytest.raises(cairn.errors.PermissionDeniedError) as e:
        cairn.latest_valid(root)
    assert "InvalidIdentityToken" in str(e.value) and bad not in str(e.value)


# ---- the config and credentials files -------------------------------------------------


def test_role_arn_with_source_profile_and_the_services_endpoint(aws, monkeypatch):
    srv, root, tmp = aws
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the config file's services section instead
    monkeypatch.delenv("AWS_REGION")
    (tmp / "config").write_text(
        f"[profile ckpt]\nrole_arn = {ROLE_ARN}\nsource_profile = base\nregion = {REGION}\n"
        f"services = local\ns3 =\n  addressing_style = path\n\n"
        f"[services local]\ns3 =\n  endpoint_url = {srv.endpoint}\n"
        f"sts =\n  endpoint_url = {srv.endpoint}\n")
    (tmp / "credentials").write_text(
        f"[base]\naws_access_key_id = {srv.admin_key}\naws_secret_access_key = {srv.admin_secret}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    _roundtrip(root + "/step_1")
    # A profile that does not exist is named in the error.
    monkeypatch.setenv("AWS_PROFILE", "nope")
    with pytest.raises(cairn.errors.PreconditionError, match="profile 'nope'"):
        cairn.latest_valid(root)


@pytest.mark.parametrize("source", ["EcsContainer", "Ec2InstanceMetadata"])
def test_role_arn_with_a_credential_source(aws, monkeypatch, source):
    """role_arn + credential_source: the source (the container endpoint, IMDS)
    hands out credentials of a role that may only assume roles; S3 accepts
    the requests only if cairn assumed the profile's role_arn with them."""
    srv, root, tmp = aws
    log = tmp / "metadata.log"
    with _metadata(srv, log, role_arn=SOURCE_ROLE_ARN) as md:
        if source == "EcsContainer":
            monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI",
                               f"http://127.0.0.1:{md.port}/creds")
        else:
            monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
            monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{md.port}")
        # The control: the source's own credentials (the chain reaching it
        # without a profile) are refused by S3.
        with pytest.raises(cairn.errors.PermissionDeniedError, match="AccessDenied"):
            cairn.latest_valid(root)
        (tmp / "config").write_text(
            f"[profile ckpt]\nrole_arn = {ROLE_ARN}\ncredential_source = {source}\n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp / "config"))
        monkeypatch.setenv("AWS_PROFILE", "ckpt")
        _roundtrip(root + "/step_1")
    assert any("key" in r for r in _records(log))  # the source was asked


def test_credential_source_environment_is_behind_the_environment_provider(aws, monkeypatch):
    """role_arn + credential_source = Environment, with keys in the
    environment: the environment provider, first in the chain, answers with
    those keys themselves and the role is not assumed, as with boto3's
    default session (botocore drops its environment provider only for a
    profile given explicitly, e.g. boto3.Session(profile_name=...), which
    cairn, configured by the environment alone, has no way to be given)."""
    import boto3
    srv, root, tmp = aws
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.source_key)  # may only assume roles
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.source_secret)
    (tmp / "config").write_text(
        f"[profile ckpt]\nrole_arn = {ROLE_ARN}\ncredential_source = Environment\n"
        f"region = {REGION}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp / "config"))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    with pytest.raises(cairn.errors.PermissionDeniedError, match="AccessDenied"):
        cairn.latest_valid(root)
    bucket, prefix = root[len("s3://"):].split("/", 1)
    with pytest.raises(Exception, match="AccessDenied"):
        boto3.session.Session().client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    # boto3 with the profile given explicitly assumes the role.
    boto3.Session(profile_name="ckpt").client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)


def test_credential_process_supplies_the_keys(aws, monkeypatch):
    srv, root, tmp = aws
    script = tmp / "creds.py"
    script.write_text(
        "import json\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {srv.key_id!r}, "
        f"'SecretAccessKey': {srv.secret!r}}}))\n")
    (tmp / "config").write_text(
        f"[default]\ncredential_process = {sys.executable} {script}\n"
        "[profile broken]\ncredential_process = sh -c 'echo SECRETOUT; exit 3'\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp / "config"))
    _roundtrip(root + "/step_1")
    monkeypatch.setenv("AWS_PROFILE", "broken")
    with pytest.raises(cairn.errors.PermissionDeniedError) as e:
        cairn.latest_valid(root)
    assert "exit status 3" in str(e.value) and "SECRETOUT" not in str(e.value)


# ---- container (ECS, EKS Pod Identity) and instance metadata (IMDSv2) ---------------------


def test_container_endpoint_with_an_authorization_token_file(aws, monkeypatch):
    srv, root, tmp = aws
    log = tmp / "metadata.log"
    token = "pod-identity-" + secrets.token_hex(16)
    with _metadata(srv, log, auth_token=token) as md:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{md.port}/creds")
        (tmp / "auth").write_text(token)
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(tmp / "auth"))
        _roundtrip(root + "/step_1")
        assert any("key" in r for r in _records(log))
        (tmp / "auth-wrong").write_text("wrong-" + token)
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(tmp / "auth-wrong"))
        with pytest.raises(cairn.errors.PermissionDeniedError) as e:
            cairn.latest_valid(root)
        assert "HTTP 401" in str(e.value) and token not in str(e.value)


def test_container_relative_uri_is_served_at_169_254_170_2(aws, monkeypatch):
    """AWS_CONTAINER_CREDENTIALS_RELATIVE_URI (ECS): http://169.254.170.2 +
    the path, on port 80, where the test serves the container endpoint."""
    srv, root, tmp = aws
    log = tmp / "metadata.log"
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost,169.254.170.2")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost,169.254.170.2")
    with _address_on_loopback("169.254.170.2"), \
            _metadata(srv, log, host="169.254.170.2", port=80):
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/creds")
        _roundtrip(root + "/step_1")
        assert "GET /creds" in [r.get("req") for r in _records(log)]
        assert any("key" in r for r in _records(log))
        # Not a path: refused, not glued onto the address.
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "@evil.example/creds")
        with pytest.raises(cairn.errors.InvalidArgumentError, match="must be a path"):
            cairn.latest_valid(root)


def test_instance_metadata_v2_uses_its_session_token(aws, monkeypatch):
    srv, root, tmp = aws
    log = tmp / "metadata.log"
    with _metadata(srv, log) as md:
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{md.port}/")
        _roundtrip(root + "/step_1")
        # Every storage opened since (the save's, the load's, this one) shared
        # the first credentials: one role lookup for all of them.
        assert cairn.latest_valid(root) == root + "/step_1"
    reqs = [r for r in _records(log) if "req" in r]
    role_gets = [r for r in reqs if r["req"].endswith(ROLE_NAME)]
    assert len(role_gets) == 1, reqs
    assert reqs[0]["req"] == "PUT /latest/api/token", reqs
    gets = [r for r in reqs if r["req"].startswith("GET")]
    assert gets and all(r["token"] for r in gets), reqs
    assert f"GET /latest/meta-data/iam/security-credentials/{ROLE_NAME}" in [r["req"] for r in gets]
    # Nothing answering at the endpoint: no credentials anywhere, and the
    # error lists what was tried.
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{md.port}/x")
    with pytest.raises(cairn.errors.PreconditionError) as e:
        cairn.latest_valid(root)
    for source in ("environment", "web identity", "profile", "container", "instance metadata"):
        assert source in str(e.value)


def test_instance_metadata_v1_fallback_unless_disabled(aws, monkeypatch):
    srv, root, tmp = aws
    log = tmp / "metadata.log"
    with _metadata(srv, log, hostile="v1") as md:
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{md.port}")
        assert cairn.latest_valid(root) is None  # signed with the IMDSv1 credentials
        assert any("key" in r for r in _records(log))
        monkeypatch.setenv("AWS_EC2_METADATA_V1_DISABLED", "true")
        with pytest.raises(cairn.errors.StorageError, match="HTTP 405"):
            cairn.latest_valid(root)


@pytest.mark.parametrize("hostile,message", [
    ("huge", "larger than 64 KiB"),
    ("garbage", "not a JSON object"),
    ("badrole", "malformed role name"),
])
def test_a_misbehaving_metadata_service_is_a_clear_error(aws, monkeypatch, hostile, message):
    srv, root, tmp = aws
    with _metadata(srv, tmp / "metadata.log", hostile=hostile) as md:
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{md.port}")
        t0 = time.monotonic()
        with pytest.raises(cairn.errors.UnavailableError, match=message) as e:
            cairn.latest_valid(root)
        assert time.monotonic() - t0 < 5
        assert "SECRETISH" not in str(e.value) and len(str(e.value)) < 600, str(e.value)


def test_a_save_spanning_credential_refreshes_succeeds(aws, monkeypatch):
    """Credentials that live 2-3 s, a link that holds each request 0.3 s, and
    a proxy that refuses expired keys (ExpiredToken): one save signs with
    several sets of credentials, refreshed in the background, none expired on
    arrival, and the checkpoint loads."""
    srv, root, tmp = aws
    md_log, proxy_log = tmp / "metadata.log", tmp / "proxy.log"
    with _metadata(srv, md_log, ttl=3) as md, \
            _Proc("proxy", "--upstream", srv.endpoint, "--expiry-log", str(md_log),
                  "--log", str(proxy_log), "--delay", "0.3") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{md.port}")
        monkeypatch.setenv("CAIRN_S3_CREDENTIALS_ADVISORY_S", "1.5")
        monkeypatch.setenv("CAIRN_S3_CREDENTIALS_MANDATORY_S", "0.7")
        monkeypatch.setenv("CAIRN_S3_CONCURRENCY", "2")
        ref = _state(7, mib=24)
        t0 = time.time()
        dcp.save(ref, storage_writer=cairn.Writer(root + "/step_1"))
        t1 = time.time()
        out = {k: torch.zeros_like(v) for k, v in ref.items()}
        dcp.load(out, storage_reader=cairn.Reader(root + "/step_1"))
        assert all(torch.equal(out[k], ref[k]) for k in ref)
    issued = {r["key"]: r["expiration"] for r in _records(md_log) if "key" in r}
    used = [r for r in _records(proxy_log) if "used" in r]
    in_save = {r["used"] for r in used if t0 <= r["at"] <= t1}
    assert len(in_save) >= 2, (t1 - t0, len(used), len(issued))
    assert all(r["at"] < issued[r["used"]] for r in used)


# ---- HTTPS with a private CA ----------------------------------------------------------------


def _make_ca(tmp, name):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"cairn test CA {name}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (tmp / f"{name}-ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp / f"{name}-cert.pem").write_bytes(cert.public_bytes(pem))
    (tmp / f"{name}-key.pem").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tmp / f"{name}-ca.pem", tmp / f"{name}-cert.pem", tmp / f"{name}-key.pem"


def test_https_with_a_private_ca_and_a_wrong_one_refused(aws, monkeypatch):
    srv, root, tmp = aws
    ca, cert, key = _make_ca(tmp, "good")
    other_ca, _, _ = _make_ca(tmp, "other")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret)
    with _Proc("proxy", "--upstream", srv.endpoint, "--cert", str(cert),
               "--keyfile", str(key)) as tls:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"https://127.0.0.1:{tls.port}")
        monkeypatch.setenv("AWS_CA_BUNDLE", str(ca))
        _roundtrip(root + "/step_1")
        # The config file's ca_bundle, when AWS_CA_BUNDLE is unset.
        monkeypatch.delenv("AWS_CA_BUNDLE")
        (tmp / "config").write_text(f"[default]\nca_bundle = {ca}\n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp / "config"))
        assert cairn.latest_valid(root) == root + "/step_1"
        # The system's CAs, or another private CA: refused at once, not retried.
        monkeypatch.delenv("AWS_CONFIG_FILE")
        for bundle in (None, other_ca):
            if bundle:
                monkeypatch.setenv("AWS_CA_BUNDLE", str(bundle))
            t0 = time.monotonic()
            with pytest.raises(cairn.errors.PreconditionError, match="TLS certificate not trusted"):
                cairn.latest_valid(root)
            assert time.monotonic() - t0 < 5
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp / "missing.pem"))
        with pytest.raises(cairn.errors.InvalidArgumentError, match="CA bundle"):
            cairn.latest_valid(root)


def test_virtual_hosted_addressing_when_configured(aws, monkeypatch):
    """s3.addressing_style = virtual against a custom endpoint: requests go to
    BUCKET.localhost:PORT (curl resolves *.localhost to loopback), through a
    proxy that records each Host and path, to moto, which reads the bucket
    from the Host header and checks the signatures (Host is signed)."""
    srv, root, tmp = aws
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret)
    (tmp / "config").write_text("[default]\ns3 =\n  addressing_style = virtual\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp / "config"))
    log = tmp / "proxy.log"
    with _Proc("proxy", "--upstream", srv.endpoint, "--log", str(log)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://localhost:{proxy.port}")
        _roundtrip(root + "/step_1")
    reqs = [r for r in _records(log) if "used" in r]
    assert reqs and all(r["host"] == f"{srv.bucket}.localhost:{proxy.port}" for r in reqs), reqs[:3]
    assert not any(r["path"].startswith(f"/{srv.bucket}") for r in reqs), reqs[:3]
    # A bucket name that cannot be a host label is refused, not mangled.
    with pytest.raises(cairn.errors.InvalidArgumentError, match="DNS-compatible"):
        cairn.latest_valid("s3://Not_A_Host/x")
