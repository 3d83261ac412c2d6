"""moto's S3 server checking upload checksums as S3 does.

S3 refuses a PutObject or UploadPart whose body does not match its
Content-MD5 header, or its ``x-amz-checksum-crc32c`` (``-crc32``, ``-sha1``,
``-sha256``) header (400 BadDigest), and stores nothing; a checksum header
that is not the base64 of a digest of the right length is 400 InvalidRequest
("Value for x-amz-checksum-crc32c header is invalid."). moto 5.x checks none
of them: it stores whatever arrived (it reads ``x-amz-checksum-*`` only to
echo it, and only with the SDKs' ``x-amz-sdk-checksum-algorithm``).
``install()`` adds S3's checks in front of moto's object requests, so a byte
changed on the way (the fault proxy's "flip") is refused by the server, as it
would be by S3, and S3's rules for multipart uploads created with
``x-amz-checksum-algorithm``:

* every UploadPart of such an upload carries that algorithm's checksum
  (else 400 InvalidRequest "Checksum Type mismatch occurred, expected
  checksum Type: crc32c, actual checksum Type: null");
* CompleteMultipartUpload lists it for every part (``<ChecksumCRC32C>``),
  equal to what the part was uploaded with (missing: 400 InvalidRequest "The
  upload was created using a crc32c checksum. The complete request must
  include the checksum for each part. It was missing for part N in the
  request."; different: 400 InvalidPart).

A verified checksum is echoed in the response (``x-amz-checksum-crc32c``), as
S3 does. Checksums sent in an aws-chunked trailer are left to moto. Everything
else is stock moto. CRC-32C is the ``crc32c`` package (scripts/setup.sh
installs it), an implementation independent of cairn's.

Usage: ``python moto_md5.py -H 127.0.0.1 -p PORT`` (moto.server's arguments);
moto_ranged.py and moto_sts.py install it too.
"""
import base64
import binascii
import hashlib
import re
import sys
import threading
from urllib.parse import parse_qs, urlparse
from xml.dom import minidom

import crc32c
from moto.s3 import responses

ALGORITHMS = {  # x-amz-checksum-<name>: digest of a body, in S3's byte order
    "crc32c": lambda b: crc32c.crc32c(b).to_bytes(4, "big"),
    "crc32": lambda b: binascii.crc32(b).to_bytes(4, "big"),
    "sha1": lambda b: hashlib.sha1(b).digest(),
    "sha256": lambda b: hashlib.sha256(b).digest(),
}
_DIGEST_BYTES = {"crc32c": 4, "crc32": 4, "sha1": 20, "sha256": 32}

_lock = threading.Lock()
_uploads = {}  # upload id -> algorithm it was created with (lower case)
_parts = {}  # (upload id, part number) -> the checksum it was uploaded with


def _error(status, code, message):
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    return status, {"Content-Type": "application/xml"}, body


def _header(request, name):
    v = request.headers.get(name)
    return v.strip() if v is not None else None


def _check_body(request, body):
    """S3's checks of a body against its checksum headers: None when it
    passes, else the error response. Also returns the verified
    {algorithm: value} (to echo)."""
    want = _header(request, "Content-MD5")
    if want:
        got = base64.b64encode(hashlib.md5(body).digest()).decode()
        if got != want:
            return _error(400, "BadDigest",
                          "The Content-MD5 you specified did not match what we received."), {}
    verified = {}
    for name, fn in ALGORITHMS.items():
        value = _header(request, f"x-amz-checksum-{name}")
        if value is None:
            continue
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != _DIGEST_BYTES[name]:
            return _error(400, "InvalidRequest",
                          f"Value for x-amz-checksum-{name} header is invalid."), {}
        if fn(body) != raw:
            return _error(400, "BadDigest", f"The {name.upper()} you specified did not match "
                          "the calculated checksum."), {}
        verified[name] = value
    return None, verified


def _trailer(request):
    """Whether the checksum travels in an aws-chunked trailer (moto's part)."""
    sha = _header(request, "x-amz-content-sha256") or ""
    return sha.startswith("STREAMING-") or bool(_header(request, "x-amz-trailer"))


def _complete_checksums(body, upload_id, algo):
    """S3's checks of a CompleteMultipartUpload body for an upload created
    with `algo`: None, or the error response."""
    try:
        parts = minidom.parseString(body).getElementsByTagName("Part")
    except Exception:  # noqa: BLE001 - moto answers MalformedXML itself
        return None
    tag = "Checksum" + algo.upper()
    for p in parts:
        try:
            pn = int(p.getElementsByTagName("PartNumber")[0].firstChild.wholeText)
        except (IndexError, AttributeError, ValueError):
            return None  # moto's own error
        given = p.getElementsByTagName(tag)
        if not given or given[0].firstChild is None:
            return _error(400, "InvalidRequest",
                          f"The upload was created using a {algo} checksum. The complete request "
                          f"must include the checksum for each part. It was missing for part {pn} "
                          "in the request.")
        with _lock:
            stored = _parts.get((upload_id, pn))
        if stored is None or given[0].firstChild.wholeText.strip() != stored:
            return _error(400, "InvalidPart",
                          "One or more of the specified parts could not be found. The part may "
                          "not have been uploaded, or the specified entity tag may not match the "
                          "part's entity tag.")
    return None


def _forget(upload_id):
    with _lock:
        _uploads.pop(upload_id, None)
        for k in [k for k in _parts if k[0] == upload_id]:
            del _parts[k]


def install():
    if getattr(responses.S3Response.key_response, "_checks_digests", False):
        return
    inner = responses.S3Response.key_response

    def key_response(self, request, full_url, headers):
        query = parse_qs(urlparse(full_url).query, keep_blank_values=True)
        upload_id = query.get("uploadId", [None])[0]
        method = request.method
        verified = {}
        if method in ("PUT", "POST") and not _trailer(request):
            body = request.get_data()
            if method == "POST" and upload_id:
                # CompleteMultipartUpload: a checksum header there is the
                # object's, not the body's; the parts' are in the body.
                if _header(request, "Content-MD5"):
                    err, _ = _check_body(request, body)
                    if err:
                        return err
                with _lock:
                    algo = _uploads.get(upload_id)
                if algo:
                    err = _complete_checksums(body, upload_id, algo)
                    if err:
                        return err
            else:
                err, verified = _check_body(request, body)
                if err:
                    return err
                part = query.get("partNumber", [None])[0]
                if method == "PUT" and upload_id and part:
                    with _lock:
                        algo = _uploads.get(upload_id)
                    if algo:
                        if algo not in verified:
                            sent = ",".join(verified) or "null"
                            return _error(400, "InvalidRequest",
                                          "Checksum Type mismatch occurred, expected checksum "
                                          f"Type: {algo}, actual checksum Type: {sent}")
                        with _lock:
                            _parts[(upload_id, int(part))] = verified[algo]
        status, hdrs, out = inner(self, request, full_url, headers)
        if method == "POST" and "uploads" in query and status == 200:
            algo = (_header(request, "x-amz-checksum-algorithm") or "").lower()
            text = out.decode() if isinstance(out, bytes) else str(out)
            m = re.search(r"<UploadId>([^<]+)</UploadId>", text)
            if m and algo in ALGORITHMS:
                with _lock:
                    _uploads[m.group(1)] = algo
        elif upload_id and status in (200, 204) and (
                method == "DELETE" or (method == "POST" and "uploads" not in query)):
            _forget(upload_id)  # aborted or completed
        if verified and 200 <= status < 300:
            hdrs = dict(hdrs)
            for name, value in verified.items():
                hdrs[f"x-amz-checksum-{name}"] = value
        return status, hdrs, out

    key_response._checks_digests = True
    responses.S3Response.key_response = key_response


if __name__ == "__main__":
    from moto.server import main

    install()
    main(sys.argv[1:])
