"""A local S3 server for cairn's tests: moto in server mode.

As a module: ``with MotoServer(auth=True) as srv: ...`` starts moto on
127.0.0.1 on a free port in its own process group (moto forks; the whole
group is killed on exit), creates the bucket ``srv.bucket`` and, with
``auth``, an IAM user whose key is the only one accepted: moto then checks
every request's SigV4 signature (auth is switched on through moto's
``/moto-api/reset-auth``, the runtime form of INITIAL_NO_AUTH_ACTION_COUNT,
after the user, its policy and the bucket were created unauthenticated).
``srv.env()`` is the environment a cairn process needs (AWS_* variables).
moto runs through moto_md5.py, which checks Content-MD5 and
x-amz-checksum-crc32c as S3 does (a body changed on the way is refused with
BadDigest), with S3's rules for uploads created with a checksum algorithm. ``ranged_gets=True`` runs moto
through moto_ranged.py (ranged GETs read only
the range; bench/s3.py uses it).

As a script: ``moto_server.py [--auth] -- CMD ARGS...`` runs CMD with that
environment plus CAIRN_TEST_S3_URI=s3://BUCKET and returns its exit status
(the ctest entries of the s3 backend use this).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

BUCKET = "cairn-test"
REGION = "us-east-1"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self, auth=False, bucket=BUCKET, ranged_gets=False, script=None):
        self.auth = auth
        # Serve ranged GETs by reading only the range (moto_ranged.py), as
        # real S3 servers do; stock moto reads the whole object every time.
        self.ranged_gets = ranged_gets
        self.bucket = bucket
        # Another wrapper of moto.server (e.g. moto_sts.py), run the same way.
        self.script = script
        self.proc = None
        self.port = None
        self.key_id = "AKIAIOSFODNN7EXAMPLE"
        self.secret = "not-a-secret-because-auth-is-off"

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout=60):
        try:
            import crc32c  # noqa: F401 - moto_md5.py checks x-amz-checksum-crc32c with it
        except ImportError:
            raise RuntimeError("the test S3 server needs the crc32c package "
                               "(scripts/setup.sh installs it)") from None
        self.port = free_port()
        env = dict(os.environ)
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        here = os.path.dirname(os.path.abspath(__file__))
        # Each checks Content-MD5 and flexible checksums as S3 does (moto_md5.py).
        script = self.script or ("moto_ranged.py" if self.ranged_gets else "moto_md5.py")
        server = [sys.executable, os.path.join(here, script)]
        self.proc = subprocess.Popen(
            server + ["-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/data.json", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not start")
                time.sleep(0.1)
        try:
            self._setup()
        except BaseException:
            self.stop()
            raise
        return self

    def _setup(self):
        import boto3
        session = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup",
                                        region_name=REGION)
        if self.auth:
            iam = session.client("iam", endpoint_url=self.endpoint)
            iam.create_user(UserName="cairn")
            iam.put_user_policy(UserName="cairn", PolicyName="s3", PolicyDocument=json.dumps({
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
            key = iam.create_access_key(UserName="cairn")["AccessKey"]
            self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        session.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=self.bucket)
        if self.auth:
            req = urllib.request.Request(self.endpoint + "/moto-api/reset-auth", data=b"0", headers={"Content-Type": "text/plain"},
                                         method="POST")
            urllib.request.urlopen(req, timeout=10).read()

    def env(self, endpoint=None):
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": REGION,
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def use(self, monkeypatch, part_size=5 << 20):
        """Points cairn at this server for one test (pytest's `monkeypatch` undoes it):
        its AWS_* variables, no stray endpoint or session token, `part_size` parts.
        Returns (a fresh s3:// root of its own, its prefix, the AWS_*/CAIRN_S3_*
        environment for child processes)."""
        for k, v in self.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
        monkeypatch.setenv("CAIRN_S3_PART_SIZE", str(part_size))
        prefix = "t-" + uuid.uuid4().hex[:12]
        env = {k: os.environ[k] for k in os.environ if k.startswith(("AWS_", "CAIRN_S3_"))}
        return f"s3://{self.bucket}/{prefix}", prefix, env

    def boto3_client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key_id,
                            aws_secret_access_key=self.secret, region_name=REGION)

    def cpu_seconds(self):
        """CPU time (user + system, seconds) used so far by the server's process
        group: the benchmark reads it around each operation to show how busy
        moto was (a Python server under one GIL: ~1.0 s per second is saturated)."""
        if self.proc is None:
            return 0.0
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # field 5, pgrp
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def stop(self):
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        except ProcessLookupError:
            pass
        # Forked children that outlived the leader.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv):
    auth = "--auth" in argv[: argv.index("--")] if "--" in argv else False
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1:]
    with MotoServer(auth=auth) as srv:
        env = dict(os.environ, **srv.env(), CAIRN_TEST_S3_URI=f"s3://{srv.bucket}")
        return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
