"""cairn over s3:// against a server or proxy that misbehaves (issue 22).

Each test puts tests/python/s3_fault_proxy.py between cairn and the module's
moto server (tests/s3/moto_server.py: signatures checked, checksums checked
as S3 does) and makes it answer as a broken server or proxy would: listings
with keys outside the requested prefix, a continuation token that never
advances, a listing that never ends (page budget, deadline), a listing
page over 1 MiB, response headers over the cap, a 200 whose body is a
truncated <Error>, a response lost after the server acted on the request, a
byte flipped in a part (CRC-32C and Content-MD5), a store that refuses or
ignores x-amz-checksum-crc32c, an absurd declared manifest size, a huge
error message, a server too slow for the operation's deadline. What must
hold: cairn never
crashes, loops, cuts a key into a wrong name, copies or deletes outside its
prefix, or reports a commit that did not happen (or a failure of one that
did).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
import torch

import cairn
import cairn.errors
from s3_fault_proxy import FaultProxy
from test_s3 import _load_equals, _save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]
CLI = os.environ.get("CAIRN_CLI", str(ROOT / "build" / "cairn"))
PART = 5 << 20


@pytest.fixture
def s3(moto, monkeypatch):
    root, prefix, _ = moto.use(monkeypatch, part_size=PART)
    return root, moto.boto3_client(), moto.bucket, prefix


@pytest.fixture
def proxy(s3, moto, monkeypatch):
    with FaultProxy(moto.port) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        monkeypatch.setenv("CAIRN_S3_RETRY_DEADLINE_S", "8")
        monkeypatch.setenv("CAIRN_S3_STALL_TIMEOUT_S", "2")
        yield p


def _state(seed=0, mib=12):
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4 // 2
    return {"w1": torch.randn(n, generator=g), "w2": torch.randn(n // 5, 5, generator=g),
            "step": torch.tensor(seed)}


def _uploads(client, bucket, prefix):
    return client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def _cli(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def _listing_of(prefix):
    """Matches the ListObjectsV2 requests for exactly `prefix` (cairn sends its
    query sorted and percent-encoded)."""
    return r"list-type=2&(max-keys=\d+&)?prefix=" + re.escape(prefix.replace("/", "%2F")) + r"$"


def _inject(keys):
    """A rewrite that adds objects `keys` to a ListObjectsV2 answer."""
    extra = "".join(f"<Contents><Key>{escape(k)}</Key><Size>1</Size></Contents>" for k in keys)

    def fn(target, status, headers, body):
        return status, headers, body.replace(b"</ListBucketResult>",
                                             extra.encode() + b"</ListBucketResult>")
    return fn


# ---- listings ----------------------------------------------------------------------


@pytest.mark.parametrize("outside", ["a", "zz" * 40 + "/bystander"], ids=["shorter", "longer"])
def test_listing_with_a_key_outside_the_prefix_is_refused(s3, proxy, outside):
    root, client, bucket, prefix = s3
    _save(root + "/step_1", _state(1, mib=1))
    proxy.add("rewrite", method="GET", path=r"list-type=2", times=-1, fn=_inject([outside]))
    r = _cli("ls", root)
    # Not killed by an uncaught exception (SIGABRT): a clear error, exit 1.
    assert r.returncode > 0, (r.returncode, r.stdout, r.stderr)
    assert "does not lie below" in r.stderr and outside[:40] in r.stderr, r.stderr
    with pytest.raises(cairn.errors.StorageError, match="does not lie below"):
        cairn.latest_valid(root)
    with pytest.raises(cairn.errors.StorageError, match="does not lie below"):
        cairn._ext.open_storage(root + "/step_1", create=False).list("")


def test_prune_and_rename_never_touch_a_listed_key_outside_the_prefix(s3, proxy):
    root, client, bucket, prefix = s3
    _save(root + "/step_1", _state(1, mib=1))
    _save(root + "/step_2", _state(2, mib=1))
    _save(root + "/step_3", _state(3, mib=1))
    bystander = "bystander-" + uuid.uuid4().hex[:8]
    client.put_object(Bucket=bucket, Key=bystander, Body=b"not cairn's")
    # Listings of step_1/ and step_2/ (what DeleteDir and Rename list) name
    # the bystander, as a broken server or proxy might.
    for step in ("step_1", "step_2"):
        proxy.add("rewrite", method="GET", path=_listing_of(f"{prefix}/{step}/"), times=-1,
                  fn=_inject([bystander]))
    r = _cli("prune", root, "-k", "2")
    assert r.returncode > 0 and "does not lie below" in r.stderr, (r.stdout, r.stderr)
    store = cairn._ext.open_storage(root)
    with pytest.raises(cairn.errors.StorageError, match="does not lie below"):
        store.rename("step_2", "moved")
    assert client.get_object(Bucket=bucket, Key=bystander)["Body"].read() == b"not cairn's"
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/moved/").get("Contents", [])
    assert listed == []
    proxy.clear()
    _load_equals(root + "/step_2", _state(2, mib=1))
    _load_equals(root + "/step_3", _state(3, mib=1))


def test_a_continuation_token_that_repeats_ends_the_listing_with_an_error(s3, proxy):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))

    # The first page says "continue with token 'same'", and so does every
    # page that token gets (a proxy that loses the token would do this).
    page = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><KeyCount>0</KeyCount>'
            b"<IsTruncated>true</IsTruncated><NextContinuationToken>same</NextContinuationToken>"
            b"</ListBucketResult>")
    proxy.add("reply", method="GET", path=r"continuation-token=same", times=-1,
              raw=b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: "
              + str(len(page)).encode() + b"\r\n\r\n" + page)

    def loop(target, status, headers, body):
        body = re.sub(rb"<IsTruncated>false</IsTruncated>",
                      b"<IsTruncated>true</IsTruncated>"
                      b"<NextContinuationToken>same</NextContinuationToken>", body)
        return status, headers, body

    proxy.add("rewrite", method="GET", path=r"list-type=2", times=-1, fn=loop)
    before = proxy.requests
    with pytest.raises(cairn.errors.StorageError, match="repeated continuation token"):
        cairn.latest_valid(root)
    assert proxy.requests - before < 20
    r = _cli("ls", root)
    assert r.returncode > 0 and "repeated continuation token" in r.stderr, r.stderr


def test_a_listing_that_never_ends_stops_at_the_operation_deadline(s3, proxy, monkeypatch):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))
    monkeypatch.setenv("CAIRN_S3_OPERATION_DEADLINE_S", "2")
    # Every page continues with a fresh token, after 0.3 s: no token repeats,
    # each request is quick; only the listing's own deadline ends it.
    pages = iter(range(1 << 30))

    def page(target):
        body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><KeyCount>0</KeyCount>'
                f"<IsTruncated>true</IsTruncated><NextContinuationToken>t{next(pages)}"
                f"</NextContinuationToken></ListBucketResult>").encode()
        return (f"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    proxy.add("reply", method="GET", path=r"delimiter=%2F&list-type=2", times=-1, raw=page,
              delay_s=0.3)
    with pytest.raises(cairn.errors.TimeoutError, match="operation's deadline"):
        cairn.latest_valid(root)
    assert next(pages) < 15


def _endless_pages(counter, marker=False):
    """A `reply` that answers every listing page with "truncated, go on with
    a fresh token" (or, for upload listings, fresh markers), counting pages."""
    def page(target):
        n = next(counter)
        if marker:
            body = (f'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult>'
                    f"<IsTruncated>true</IsTruncated><NextKeyMarker>k{n}</NextKeyMarker>"
                    f"<NextUploadIdMarker>u{n}</NextUploadIdMarker></ListMultipartUploadsResult>")
        else:
            body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><KeyCount>0'
                    f"</KeyCount><IsTruncated>true</IsTruncated><NextContinuationToken>t{n}"
                    f"</NextContinuationToken></ListBucketResult>")
        body = body.encode()
        return (f"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    return page


def test_a_listing_past_its_page_budget_ends_with_an_error(s3, proxy, monkeypatch):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))
    monkeypatch.setenv("CAIRN_S3_MAX_LIST_PAGES", "5")
    # Every page continues with a fresh token, at once: no token repeats and
    # the deadline is far; only the page budget ends the listing.
    pages = itertools.count(1)
    proxy.add("reply", method="GET", path=r"delimiter=%2F&list-type=2", times=-1,
              raw=_endless_pages(pages))
    with pytest.raises(cairn.errors.StorageError, match=r"more than 5 pages.*MAX_LIST_PAGES"):
        cairn.latest_valid(root)
    assert next(pages) == 6  # pages 1-5 were fetched, then the listing stopped
    # The same for the listing of multipart uploads (cairn prune).
    proxy.clear()
    uploads = itertools.count(1)
    proxy.add("reply", method="GET", path=r"uploads=", times=-1,
              raw=_endless_pages(uploads, marker=True))
    r = _cli("prune", root, "-k", "1")
    assert r.returncode > 0 and "more than 5 pages" in r.stderr, (r.stdout, r.stderr)
    assert next(uploads) == 6
    proxy.clear()
    assert cairn.latest_valid(root) == root + "/step_1"


def test_a_listing_page_over_one_mib_is_parsed(s3, proxy):
    root, client, bucket, prefix = s3
    _save(root + "/step_1", _state(1, mib=1))
    # 1000 keys of 1024 bytes (S3's longest): a valid page of ~1.1 MB.
    names = [f"{i:04d}" + "k" * (1024 - len(prefix) - 5) for i in range(1000)]
    rule = proxy.add("rewrite", method="GET", path=r"delimiter=%2F&" + _listing_of(prefix + "/"),
                     times=-1, fn=_inject([f"{prefix}/{n}" for n in names]))
    entries = cairn._ext.open_storage(root).list("")
    assert rule.hits >= 1
    files = sorted(e[0] for e in entries if not e[1])
    assert files == names
    assert cairn.latest_valid(root) == root + "/step_1"


def _pad_headers(kib):
    """A rewrite that adds `kib` KiB of response headers (8000-byte values)."""
    def fn(target, status, headers, body):
        pad = [(f"x-amz-meta-pad{i}", "p" * 8000) for i in range(kib * 1024 // 8020 + 1)]
        return status, headers + pad, body
    return fn


def test_response_headers_over_the_cap_are_refused_and_retried(s3, proxy, monkeypatch):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))
    listing = r"delimiter=%2F&" + _listing_of(s3[3] + "/")
    # Under the cap (256 KiB, http.h's kMaxHeaderBytes): an answer like any.
    rule = proxy.add("rewrite", method="GET", path=listing, times=-1, fn=_pad_headers(200))
    assert cairn.latest_valid(root) == root + "/step_1"
    assert rule.hits >= 1
    proxy.clear()
    # Over it, once: that answer is refused (the transfer aborted, never kept)
    # and the request sent again.
    rule = proxy.add("rewrite", method="GET", path=listing, times=1, fn=_pad_headers(320))
    assert cairn.latest_valid(root) == root + "/step_1"
    assert rule.hits == 1
    # Always: a clear error once the attempts run out.
    monkeypatch.setenv("CAIRN_S3_MAX_ATTEMPTS", "2")
    proxy.add("rewrite", method="GET", path=listing, times=-1, fn=_pad_headers(320))
    with pytest.raises(cairn.errors.UnavailableError, match="response headers too long"):
        cairn.latest_valid(root)


# ---- commits -------------------------------------------------------------------------


def test_a_200_with_a_truncated_error_body_is_no_completed_upload(s3, proxy, monkeypatch):
    root, client, bucket, prefix = s3
    truncated = (b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nConnection: close\r\n\r\n"
                 b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code><Mess')
    # Once: the retry completes the upload and the save succeeds.
    rule = proxy.add("reply", method="POST", path=r"uploadId=", times=1, raw=truncated)
    _save(root + "/step_1", _state(1))
    assert rule.hits == 1
    cairn.verify(root + "/step_1")
    _load_equals(root + "/step_1", _state(1))
    # Always: the save fails and commits nothing.
    monkeypatch.setenv("CAIRN_S3_MAX_ATTEMPTS", "3")
    proxy.add("reply", method="POST", path=r"uploadId=", times=-1, raw=truncated)
    with pytest.raises(BaseException) as e:  # dcp's CheckpointException
        _save(root + "/step_2", _state(2))
    assert "unparsable error body" in str(e.value), e.value
    proxy.clear()
    assert cairn.latest_valid(root) == root + "/step_1"
    assert _uploads(client, bucket, prefix) == []


def test_a_lost_answer_to_the_manifest_put_is_a_successful_save(s3, proxy):
    root, *_ = s3
    # The server stores the manifest; its answer never arrives; the retry
    # (If-None-Match: *) meets 412 and finds its own bytes there.
    rule = proxy.add("drop_response", method="PUT", path=r"cairn\.manifest", times=1)
    _save(root + "/step_1", _state(1, mib=1))
    assert rule.hits == 1
    assert cairn.latest_valid(root) == root + "/step_1"
    _load_equals(root + "/step_1", _state(1, mib=1))


def test_a_lost_answer_to_a_completed_upload_is_a_completed_upload(s3, proxy):
    root, client, bucket, prefix = s3
    # The server completes the upload, the answer is lost, cairn completes it
    # again. moto answers the repeat with 200 and its result; a server that
    # answers NoSuchUpload instead is accepted when the object's ETag is the
    # one these parts make (MD5 of their MD5s), a path moto does not take.
    rule = proxy.add("drop_response", method="POST", path=r"uploadId=", times=1)
    _save(root + "/step_1", _state(1))
    assert rule.hits == 1
    _load_equals(root + "/step_1", _state(1))
    assert _uploads(client, bucket, prefix) == []


def test_a_retried_create_of_an_upload_leaves_no_orphan(s3, proxy):
    root, client, bucket, prefix = s3
    rule = proxy.add("drop_response", method="POST", path=r"[?&]uploads=", times=1)
    _save(root + "/step_1", _state(1))
    assert rule.hits == 1
    assert _uploads(client, bucket, prefix) == []
    _load_equals(root + "/step_1", _state(1))


# ---- integrity and bounds ----------------------------------------------------------------


def _sent(proxy, method, path):
    """The checksum headers of the requests `proxy` saw for `method` and
    target regex `path`: a list of {name: value}."""
    return [{k: v for k, v in h.items() if k.startswith("x-amz-checksum") or k == "content-md5"}
            for m, t, h in proxy.seen if m == method and re.search(path, t)]


@pytest.mark.parametrize("mode,header", [("crc32c", "x-amz-checksum-crc32c"),
                                         ("md5", "content-md5")])
def test_a_byte_flipped_in_a_part_is_refused_by_the_server_and_resent(s3, proxy, monkeypatch,
                                                                      mode, header):
    root, *_ = s3
    if mode != "crc32c":
        monkeypatch.setenv("CAIRN_S3_CHECKSUM", mode)
    rule = proxy.add("flip", method="PUT", path=r"partNumber=", times=1)
    _save(root + "/step_1", _state(1))
    assert rule.hits == 1
    cairn.verify(root + "/step_1")
    _load_equals(root + "/step_1", _state(1))
    # Every part carried the checksum (the flipped one twice: refused with
    # BadDigest, then resent) and nothing else; with CRC-32C the upload was
    # created with the algorithm (then S3 wants it for every part and in the
    # completion, which moto_md5.py checks as S3 does).
    parts = _sent(proxy, "PUT", r"/step_1/data/.*partNumber=")
    assert len(parts) >= 4 and all(list(p) == [header] for p in parts), parts
    creates = _sent(proxy, "POST", r"/step_1/data/.*uploads=")
    assert creates == [{"x-amz-checksum-algorithm": "CRC32C"} if mode == "crc32c" else {}]
    assert all(list(p) == [header] for p in _sent(proxy, "PUT", r"/step_1/cairn\.manifest"))


def test_without_checksums_a_flipped_byte_is_found_only_at_load(s3, proxy, monkeypatch):
    root, *_ = s3
    # The control: with no checksum the server stores the damaged part, and
    # only cairn's own checksums find it, at load.
    monkeypatch.setenv("CAIRN_S3_CHECKSUM", "off")
    proxy.add("flip", method="PUT", path=r"partNumber=", times=1)
    _save(root + "/step_2", _state(2))
    assert all(p == {} for p in _sent(proxy, "PUT", r"/step_2/"))
    with pytest.raises(cairn.CorruptionError):
        cairn.verify(root + "/step_2")
    monkeypatch.setenv("CAIRN_S3_CHECKSUM", "sha1")
    with pytest.raises(cairn.errors.InvalidArgumentError, match="CAIRN_S3_CHECKSUM"):
        cairn.latest_valid(root)


_SAVE_STEPS = """
import sys
import torch, torch.distributed.checkpoint as dcp
import cairn
for step in sys.argv[2:]:
    g = torch.Generator().manual_seed(int(step))
    sd = {"w": torch.randn(3 << 20, generator=g), "step": torch.tensor(int(step))}
    dcp.save(sd, storage_writer=cairn.Writer(f"{sys.argv[1]}/step_{step}"))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=cairn.Reader(f"{sys.argv[1]}/step_{step}"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)
"""


def _save_in_child(root, *steps):
    """Saves and loads 12 MiB states at root/step_N in a fresh process (what
    cairn learns about an endpoint's checksums lasts for a process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-W", "ignore", "-c", _SAVE_STEPS, root,
                           *map(str, steps)], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("answer", [
    (400, "InvalidArgument", "Unsupported header 'x-amz-checksum-crc32c' received for this API "
     "call."),
    (501, "NotImplemented", "A header you provided implies functionality that is not "
     "implemented"),
], ids=["b2-style", "not-implemented"])
def test_a_store_that_refuses_crc32c_gets_content_md5(s3, proxy, answer):
    root, *_ = s3
    status, code, message = answer
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    raw = (f"HTTP/1.1 {status} Refused\r\nContent-Type: application/xml\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    # A store without flexible checksums: whatever carries one is refused.
    rule = proxy.add("reply", header=r"^x-amz-checksum-", times=-1, raw=raw)
    r = _save_in_child(root, 1, 2)
    assert r.returncode == 0, r.stderr
    # Refused once (the first upload's create), then Content-MD5 for every
    # body of both saves; said once.
    assert 1 <= rule.hits <= 2, rule.hits
    assert r.stderr.count("refused x-amz-checksum-crc32c as unsupported") == 1, r.stderr
    assert "Content-MD5 instead" in r.stderr and code in r.stderr
    bodies = _sent(proxy, "PUT", r"/step_\d/")
    assert len(bodies) >= 8 and all(list(p) == ["content-md5"] for p in bodies), bodies
    assert _sent(proxy, "POST", r"uploads=")[-1] == {}
    assert cairn.latest_valid(root) == root + "/step_2"


def test_a_store_that_ignores_crc32c_gets_content_md5(s3, proxy):
    root, *_ = s3

    def no_echo(target, status, headers, body):
        return status, [(k, v) for k, v in headers if not k.lower().startswith("x-amz-checksum")], body

    # A store that ignores the header: it never echoes it, as S3 does the
    # checksums it verified.
    proxy.add("rewrite", method="PUT", times=-1, fn=no_echo)
    r = _save_in_child(root, 1, 2)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("did not echo it") == 1, r.stderr
    # The upload in flight keeps the CRC-32C it was created with; the second
    # save is all Content-MD5.
    assert _sent(proxy, "POST", r"/step_2/.*uploads=") == [{}]
    second = _sent(proxy, "PUT", r"/step_2/")
    assert len(second) >= 4 and all(list(p) == ["content-md5"] for p in second), second
    assert cairn.latest_valid(root) == root + "/step_2"


def test_a_huge_declared_manifest_size_is_not_allocated(s3, proxy):
    root, *_ = s3
    _save(root + "/step_1", _state(1, mib=1))

    def huge(target, status, headers, body):  # "bytes 0-N/TOTAL", TOTAL just under the cap
        return status, [(k, re.sub(r"/\d+$", f"/{(1 << 30) - 4096}", v)
                         if k.lower() == "content-range" else v) for k, v in headers], body

    proxy.add("rewrite", method="GET", path=r"cairn\.manifest", times=-1, fn=huge)
    # The peak memory of `cairn verify`, from a small Python parent (a child's
    # ru_maxrss includes what its parent held when it forked: not pytest).
    r = subprocess.run([sys.executable, "-c", _PEAK_KIB, CLI, "verify", root + "/step_1"],
                       capture_output=True, text=True, timeout=120)
    code, peak_kib = (int(x) for x in r.stdout.split())
    assert code > 0, r.stderr
    assert "manifest" in r.stderr and "header says" in r.stderr, r.stderr
    # ru_maxrss is in KiB: ~15 MiB here; reading what the size declared
    # (1 GiB, zero-filled) first peaked at 200 MiB before the read failed.
    assert peak_kib < 64 << 10, peak_kib


_PEAK_KIB = """
import os, subprocess, sys
pid = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL).pid
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def test_a_huge_error_message_is_cut(s3, proxy):
    root, *_ = s3
    message = "x" * (200 << 10)
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
            f"<Message>{message}</Message></Error>").encode()
    raw = (f"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    proxy.add("reply", method="GET", path=r"list-type=2", times=-1, raw=raw)
    with pytest.raises(cairn.errors.PermissionDeniedError) as e:
        cairn.latest_valid(root)
    assert "AccessDenied" in str(e.value) and len(str(e.value)) < 2000, len(str(e.value))


def test_a_read_slower_than_the_operation_deadline_fails_in_time(s3, proxy, monkeypatch):
    root, *_ = s3
    _save(root + "/step_1", _state(1))
    monkeypatch.setenv("CAIRN_S3_OPERATION_DEADLINE_S", "1")
    # Every GET of a data file takes 1.5 s: each request would succeed within
    # its own limits (stall 2 s, retries 8 s), a read of 1 s may not.
    proxy.add("delay", method="GET", path=r"/data/", times=-1, delay_s=1.5)
    with pytest.raises(cairn.errors.TimeoutError, match="operation's deadline"):
        cairn.verify(root + "/step_1")
