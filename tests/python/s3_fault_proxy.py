"""A fault-injecting HTTP proxy for the s3 backend's tests.

``FaultProxy(upstream_port)`` listens on 127.0.0.1 (a free port, loopback
only) and forwards each HTTP/1.1 request to the S3 server on
``127.0.0.1:upstream_port``, keeping one upstream connection per client
connection. Rules chosen by the test replace chosen requests by a fault:

    proxy.add("503", method="PUT", path=r"partNumber=", times=2)

* ``"503"``   answer 503 SlowDown (S3's throttling reply), not forwarded;
* ``"500"``   answer 500 InternalError, not forwarded;
* ``"reset"`` read the request, then reset the connection (RST);
* ``"stall"`` read the request, then never answer (until ``stall_s`` passes
  or the proxy stops), the connection left open;
* ``"delay"`` wait ``delay_s``, then forward;
* ``"drop_response"`` forward the request (the server acts on it), then
  reset the connection instead of answering: a response lost on the way;
* ``"flip"`` forward the request with one byte of its body (the middle one)
  flipped: corruption in transit;
* ``"reply"`` answer with the raw bytes ``raw`` (status line, headers and
  body, as given; or ``raw(target)``'s), after ``delay_s``, then close the
  connection, not forwarded;
* ``"rewrite"`` forward, then answer ``fn(target, status, headers, body)``,
  which returns a new ``(status, headers, body)`` (headers: a list of
  (name, value); Content-Length is set by the proxy).

A rule matches on the method, a regular expression searched in the
request target (path and query) and, with ``header``, one searched in the
request's header names (lower case: ``header=r"^x-amz-checksum-"`` matches
requests that carry a flexible checksum); ``times`` is how often it fires (-1:
always); ``rule.hits`` counts firings and ``proxy.wait_for(rule)`` blocks
until it fired (tests synchronize on it instead of sleeping).
``proxy.seen`` holds the last 10000 requests as (method, target, {lower-case
header name: value}). Bounded: at most 64 client connections at once;
``stop()`` closes everything and joins every thread.
"""

from __future__ import annotations

import collections
import http.client
import re
import socket
import struct
import threading

MAX_CONNECTIONS = 64
_FAULT_BODIES = {
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
}


FAULTS = ("503", "500", "reset", "stall", "delay", "drop_response", "flip", "reply", "rewrite")


class Rule:
    def __init__(self, fault, method, path, times, stall_s, delay_s=0.0, raw=b"", fn=None,
                 header=None):
        if fault not in FAULTS:
            raise ValueError(fault)
        if fault == "rewrite" and fn is None:
            raise ValueError("rewrite needs fn")
        self.fault, self.method, self.times, self.stall_s = fault, method, times, stall_s
        self.delay_s, self.raw, self.fn = delay_s, raw, fn
        self.path = re.compile(path) if path else None
        self.header = re.compile(header) if header else None
        self.hits = 0
        self.fired = threading.Event()


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.requests = 0
        self.seen = collections.deque(maxlen=10000)
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, fault, method=None, path=None, times=1, stall_s=600.0, delay_s=0.0, raw=b"",
            fn=None, header=None) -> Rule:
        rule = Rule(fault, method, path, times, stall_s, delay_s, raw, fn, header)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def wait_for(self, rule: Rule, timeout=60.0) -> None:
        if not rule.fired.wait(timeout):
            raise AssertionError(f"fault {rule.fault} never fired")

    def stop(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in list(self._socks):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._accept.join()
        for t in list(self._threads):
            t.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- internals ----

    def _match(self, method: str, target: str, headers: dict) -> Rule | None:
        with self._lock:
            self.requests += 1
            self.seen.append((method, target, headers))
            for r in self._rules:
                if r.times == 0:
                    continue
                if r.method and r.method != method:
                    continue
                if r.path and not r.path.search(target):
                    continue
                if r.header and not any(r.header.search(k) for k in headers):
                    continue
                if r.times > 0:
                    r.times -= 1
                r.hits += 1
                r.fired.set()
                return r
        return None

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(timeout=30):
                conn.close()
                continue
            with self._lock:
                self._socks.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = []
                length = 0
                for line in lines[1:]:
                    k, v = line.split(":", 1)
                    headers.append((k.strip(), v.strip()))
                    if k.strip().lower() == "content-length":
                        length = int(v)
                while len(buf) < length:
                    chunk = conn.recv(max(65536, length - len(buf)))
                    if not chunk:
                        return
                    buf += chunk
                body, buf = buf[:length], buf[length:]
                rule = self._match(method, target, {k.lower(): v for k, v in headers})
                if rule is not None and rule.fault in _FAULT_BODIES:
                    status, reason, code, msg = _FAULT_BODIES[rule.fault]
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                           f"<Message>{msg}</Message></Error>").encode()
                    conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                                 f"Content-Length: {len(xml)}\r\n\r\n".encode() + xml)
                    continue
                if rule is not None and rule.fault == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if rule is not None and rule.fault == "stall":
                    self._stop.wait(rule.stall_s)
                    return
                if rule is not None and rule.fault == "reply":
                    if rule.delay_s and self._stop.wait(rule.delay_s):
                        return
                    conn.sendall(rule.raw(target) if callable(rule.raw) else rule.raw)
                    return
                if rule is not None and rule.fault == "delay":
                    if self._stop.wait(rule.delay_s):
                        return
                if rule is not None and rule.fault == "flip" and body:
                    bad = bytearray(body)
                    bad[len(bad) // 2] ^= 0x01
                    body = bytes(bad)
                upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    upstream.putheader(k, v)
                upstream.endheaders(body if body else None)
                resp = upstream.getresponse()
                data = resp.read()
                if rule is not None and rule.fault == "drop_response":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
                if rule is not None and rule.fault == "rewrite":
                    status, resp_headers, data = rule.fn(target, status, list(resp_headers), data)
                out = [f"HTTP/1.1 {status} {reason}"]
                for k, v in resp_headers:
                    if k.lower() in ("transfer-encoding", "connection", "content-length"):
                        continue
                    out.append(f"{k}: {v}")
                if method == "HEAD":
                    out.append(f"Content-Length: {resp.getheader('Content-Length', '0')}")
                else:
                    out.append(f"Content-Length: {len(data)}")
                conn.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + data)
                if resp.will_close:
                    upstream.close()
        except (OSError, ValueError, http.client.HTTPException):
            return
        finally:
            upstream.close()
            with self._lock:
                self._socks.discard(conn)
            conn.close()
            self._slots.release()
