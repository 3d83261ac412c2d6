"""Loopback stand-ins for the AWS endpoints the credential chain talks to
(tests/python/test_s3_credentials.py starts them as subprocesses, each in its
own process group).

``aws_endpoints.py metadata --moto URL --key K --secret S --role-arn ARN
--ttl SECONDS [--auth-token T] [--log FILE]`` serves, on one port:
  * IMDSv2 as AWS documents it: ``PUT /latest/api/token`` with
    ``X-aws-ec2-metadata-token-ttl-seconds`` (1..21600, else 400) returns a
    session token; ``GET /latest/meta-data/iam/security-credentials/`` and
    ``.../<role>`` require ``X-aws-ec2-metadata-token`` (missing or unknown:
    401) and return the role name and its credentials JSON (Code, Type,
    AccessKeyId, SecretAccessKey, Token, Expiration, LastUpdated);
  * the container endpoint (ECS, EKS Pod Identity): ``GET /creds`` with
    ``Authorization: <auth-token>`` (wrong or missing: 401) returns
    {AccessKeyId, SecretAccessKey, Token, Expiration, RoleArn}.
Every set of credentials is real: a fresh STS AssumeRole of ARN at moto, so
moto's S3 (auth on) accepts only those. Their Expiration is --ttl seconds
ahead (short, to exercise refresh). Each issuance is appended to --log as a
JSON line {key, expiration} (epoch seconds), and each request as {req: ...}.
``--hostile huge|garbage|badrole`` makes IMDS misbehave instead: a 2 MiB
credentials answer, one that is not JSON, a role name that is a path;
``--hostile v1`` is an IMDSv1-only service (405 to the token PUT, no token
needed).

``aws_endpoints.py proxy --upstream URL [--cert PEM --keyfile PEM]
[--expiry-log FILE] [--log FILE] [--delay S]`` forwards every request unchanged (Host included, so
SigV4 signatures still verify at moto) to URL; with --cert it speaks TLS;
with --expiry-log it answers 400 ExpiredToken to a request signed with a key
whose logged expiration has passed, as S3 does; with --log it appends
{used: key, at: time, host, path} for every signed request; --delay holds each request
that long (a slow link, so that one save spans several credential lifetimes).

Both listen on 127.0.0.1 on a free port unless ``--host``/``--port`` say
otherwise (the ECS endpoint is ``http://169.254.170.2:80``), and print their
port on stdout once listening.
"""
import argparse
import http.client
import http.server
import json
import os
import re
import secrets
import ssl
import sys
import threading
import time
from datetime import datetime, timezone
from urllib.parse import urlparse


def iso(t):
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Log:
    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()

    def write(self, **rec):
        if not self.path:
            return
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def metadata(args):
    import boto3

    sts = boto3.client("sts", endpoint_url=args.moto, aws_access_key_id=args.key,
                       aws_secret_access_key=args.secret, region_name="us-east-1")
    log = Log(args.log)
    role = args.role_arn.rsplit("/", 1)[-1]
    tokens = {}  # IMDS session token -> expiry
    lock = threading.Lock()

    def issue():
        c = sts.assume_role(RoleArn=args.role_arn, RoleSessionName="imds",
                            DurationSeconds=900)["Credentials"]
        exp = int(time.time()) + int(args.ttl)  # whole seconds, as AWS writes them
        log.write(key=c["AccessKeyId"], expiration=exp)
        return {"AccessKeyId": c["AccessKeyId"], "SecretAccessKey": c["SecretAccessKey"],
                "Token": c["SessionToken"], "Expiration": iso(exp)}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, code, body, ctype="text/plain"):
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            log.write(req=f"PUT {self.path}")
            if self.path != "/latest/api/token":
                return self.reply(404, "not found")
            if args.hostile == "v1":  # a metadata service without IMDSv2
                return self.reply(405, "method not allowed")
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self.reply(400, "bad ttl")
            tok = secrets.token_urlsafe(32)
            with lock:
                tokens[tok] = time.time() + int(ttl)
            self.reply(200, tok)

        def do_GET(self):
            log.write(req=f"GET {self.path}",
                      token="x-aws-ec2-metadata-token" in {k.lower() for k in self.headers})
            base = "/latest/meta-data/iam/security-credentials/"
            if self.path.startswith(base):
                tok = self.headers.get("X-aws-ec2-metadata-token")
                with lock:
                    ok = tok is not None and tokens.get(tok, 0) > time.time()
                ok = ok or (args.hostile == "v1" and tok is None)
                if not ok:
                    return self.reply(401, "")
                rest = self.path[len(base):]
                if rest == "":
                    return self.reply(200, "../../../evil\n" if args.hostile == "badrole" else role)
                if rest != role:
                    return self.reply(404, "not found")
                if args.hostile == "huge":
                    return self.reply(200, '{"AccessKeyId": "' + "A" * (2 << 20) + '"}',
                                      "application/json")
                if args.hostile == "garbage":
                    return self.reply(200, "<html>SECRETISH not json</html>", "text/html")
                c = issue()
                c.update(Code="Success", Type="AWS-HMAC", LastUpdated=iso(time.time()))
                return self.reply(200, json.dumps(c), "application/json")
            if self.path == "/creds":
                if args.auth_token and self.headers.get("Authorization") != args.auth_token:
                    return self.reply(401, json.dumps({"code": "AccessDenied"}),
                                      "application/json")
                c = issue()
                c["RoleArn"] = args.role_arn
                return self.reply(200, json.dumps(c), "application/json")
            self.reply(404, "not found")

    return Handler


def proxy(args):
    up = urlparse(args.upstream)
    log = Log(args.log)
    keyre = re.compile(r"Credential=([A-Z0-9]+)/")

    def expired(key):
        if not args.expiry_log or not os.path.exists(args.expiry_log):
            return False
        with open(args.expiry_log) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("key") == key:
                    return time.time() > rec["expiration"]
        return False

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def forward(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            m = keyre.search(self.headers.get("Authorization", ""))
            if m and expired(m.group(1)):
                data = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ExpiredToken</Code>"
                        b"<Message>The provided token has expired.</Message></Error>")
                self.send_response(400)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            if m:
                log.write(used=m.group(1), at=time.time(), host=self.headers.get("Host", ""),
                          path=self.path)
            if args.delay:
                time.sleep(args.delay)
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
            try:
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("connection", "keep-alive")}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                has_len = False
                for k, v in r.getheaders():
                    if k.lower() in ("transfer-encoding", "connection", "keep-alive"):
                        continue
                    has_len |= k.lower() == "content-length"
                    self.send_header(k, v)
                if not has_len:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

    return Handler


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("metadata")
    m.add_argument("--moto", required=True)
    m.add_argument("--key", required=True)
    m.add_argument("--secret", required=True)
    m.add_argument("--role-arn", required=True)
    m.add_argument("--ttl", type=int, default=3600)
    m.add_argument("--auth-token", default="")
    m.add_argument("--log", default="")
    m.add_argument("--hostile", default="", choices=["", "huge", "garbage", "badrole", "v1"])
    p = sub.add_parser("proxy")
    p.add_argument("--upstream", required=True)
    p.add_argument("--cert", default="")
    p.add_argument("--keyfile", default="")
    p.add_argument("--expiry-log", default="")
    p.add_argument("--log", default="")
    p.add_argument("--delay", type=float, default=0)
    for sp in (m, p):
        sp.add_argument("--host", default="127.0.0.1")
        sp.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    handler = metadata(args) if args.cmd == "metadata" else proxy(args)
    srv = http.server.ThreadingHTTPServer((args.host, args.port), handler)
    srv.daemon_threads = True
    if args.cmd == "proxy" and args.cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.cert, args.keyfile)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
