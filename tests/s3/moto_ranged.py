"""moto's S3 server with two paths fixed for large objects (bench/s3.py).

1. Ranged GETs read only the range. Stock moto (5.x) materializes the whole
   object for every GET and then slices the requested range out of it: a ranged
   GET of 8 MiB from a 1 GB object reads 1 GB and holds a 1 GB copy while it
   does. With 16 ranged GETs in flight that is 16 GB of transient memory, and
   the cost of a load grows with (object size x number of requests) instead of
   bytes moved, which no real S3 server does. Here, when a GET carries a Range
   header, the object's value is a lazy view whose slice reads just the range.

2. Objects are stored without copies. Stock moto writes every value (a part,
   an object) into a SpooledTemporaryFile that rolls over to a file in /tmp
   past 5 MiB, and its FakeMultipart.complete reads every part twice, appends
   it to two bytearrays (the object, and a second copy of it for the
   FULL_OBJECT checksum), converts both to ``bytes`` (two more copies) and
   writes the result into a new spooled file. For a 1 GB object that is ~5 GB
   of transient memory and ~6 GB of copying under the GIL, on fresh pages
   (this VM takes ~10 s to fault in and fill 1 GB), while every other request
   waits: the floor's 1 GB complete took 74 s on the shared 2-core VM, and a
   client that timed it out and retried sent a second complete for an upload
   the first one was still assembling; when the first finished, the retry's
   ``bucket.multiparts[upload_id]`` raised KeyError: HTTP 500. Here a value
   is held as the ``bytes`` the request body already is (``BytesIO(bytes)``
   shares it), and a completed object is the list of its parts' ``bytes``
   (no copy at all: ``_PartsFile``), so a complete costs what its checksum
   costs. The checksum semantics are stock moto's (COMPOSITE: one per part;
   FULL_OBJECT, the default CRC64NVME, which falls back to a CRC32 without
   awscrt: over the whole object, computed part by part). Completes run one
   at a time, and a retried complete of an upload that was already completed
   answers as S3 does, with the completed object, instead of a 500.

3. Content-MD5 and x-amz-checksum-crc32c are checked as S3 checks them
   (moto_md5.py).

Everything else is stock moto. Every peer of the benchmark talks to the same
patched server, so the comparison stays fair.

Usage: ``python moto_ranged.py -H 127.0.0.1 -p PORT`` (moto.server's arguments).
"""
import base64
import binascii
import bisect
import codecs
import hashlib
import io
import itertools
import sys
import threading

from moto.s3 import exceptions, models, responses, utils
from moto.s3.utils import compute_checksum
from moto.utilities.utils import md5_hash

_local = threading.local()
_value = models.FakeKey.value


class _Assembled:
    """A completed multipart object's value: its parts' bytes, in order."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.size = sum(len(c) for c in chunks)

    def __len__(self):
        return self.size


class _PartsFile:
    """A read-only file over a list of bytes objects (a completed object's
    parts), enough of a SpooledTemporaryFile for FakeKey: seek, tell, read,
    close. Reading the whole object joins the parts (one copy, as stock)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.starts = list(itertools.accumulate((len(c) for c in chunks), initial=0))
        self.size = self.starts[-1]
        self.pos = 0

    def seek(self, pos, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if self.pos >= end:
            return b""
        i = bisect.bisect_right(self.starts, self.pos) - 1
        out = []
        pos = self.pos
        while pos < end:
            c, c0 = self.chunks[i], self.starts[i]
            take = min(end, c0 + len(c)) - pos
            out.append(c if (pos == c0 and take == len(c)) else c[pos - c0:pos - c0 + take])
            pos += take
            i += 1
        self.pos = end
        return out[0] if len(out) == 1 else b"".join(out)

    def close(self):
        self.chunks = []


def _value_set(key, new_value):
    if isinstance(new_value, str):  # stock moto accepts str values too
        new_value = new_value.encode("utf-8")
    if isinstance(new_value, _Assembled):
        buf = _PartsFile(new_value.chunks)
    else:
        buf = io.BytesIO(bytes(new_value))  # shares a bytes value: no copy
    old = getattr(key, "_value_buffer", None)
    key._value_buffer = buf
    if old is not None:
        old.close()
    key.contentsize = len(new_value)


class _LazyValue:
    """A FakeKey's bytes, read on slicing only."""

    def __init__(self, key):
        self.key = key
        self.size = key.size

    def __len__(self):
        return self.size

    def __bool__(self):
        return self.size > 0

    def __getitem__(self, sl):
        if not isinstance(sl, slice):
            raise TypeError("only slices of an object's value are supported")
        start, stop, _ = sl.indices(self.size)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))

    def __bytes__(self):
        return _value.fget(self.key)


def _value_get(key):
    if getattr(_local, "lazy", False):
        return _LazyValue(key)
    return _value.fget(key)


models.FakeKey.value = property(_value_get, _value_set)
_key_response = responses.S3Response.key_response


def _key_response_ranged(self, request, full_url, headers):
    _local.lazy = request.method == "GET" and bool(request.headers.get("range"))
    try:
        status, hdrs, body = _key_response(self, request, full_url, headers)
    finally:
        _local.lazy = False
    if isinstance(body, _LazyValue):  # a path that did not slice it
        body = bytes(body)
    return status, hdrs, body


responses.S3Response.key_response = _key_response_ranged


def _part_bytes(part):
    with part.lock:
        part._value_buffer.seek(0)
        return part._value_buffer.read()  # the part's own bytes (BytesIO shares them)


def _complete(self, body):
    """FakeMultipart.complete with the same checks and results as stock moto
    5.2 (InvalidPart, EntityTooSmall, MalformedXML; ETag md5-of-md5s "-N";
    the COMPOSITE or FULL_OBJECT checksum), the object its parts' bytes."""
    builder = models.MultipartChecksumBuilder(self.metadata.get("x-amz-checksum-algorithm"),
                                              self.metadata.get("x-amz-checksum-type"))
    decode_hex = codecs.getdecoder("hex_codec")
    chunks = []
    md5s = bytearray()
    last = None
    for pn, etag in body:
        part = self.parts.get(pn)
        if part is None or part.etag.replace('"', "") != etag.replace('"', ""):
            raise exceptions.InvalidPart()
        if last is not None and last.contentsize < models.S3_UPLOAD_PART_MIN_SIZE:
            raise exceptions.EntityTooSmall()
        md5s.extend(decode_hex(part.etag.replace('"', ""))[0])
        chunks.append(_part_bytes(part))
        last = part
    if not chunks:
        raise exceptions.MalformedXML
    algo = builder.checksum_algorithm
    if builder.checksum_type == "COMPOSITE":
        sums = b"".join(compute_checksum(c, algo, encode_base64=False) for c in chunks)
        checksum = (builder.checksum_type, compute_checksum(sums, algo).decode(), len(chunks))
    else:
        checksum = (builder.checksum_type, _full_object_checksum(chunks, algo), 1)
    full_etag = md5_hash()
    full_etag.update(bytes(md5s))
    return _Assembled(chunks), f"{full_etag.hexdigest()}-{len(chunks)}", checksum


def _full_object_checksum(chunks, algo):
    """compute_checksum(b"".join(chunks), algo), without the join."""
    if algo in ("SHA1", "SHA256"):
        h = hashlib.new(algo.lower(), usedforsecurity=False)
        for c in chunks:
            h.update(c)
        return base64.b64encode(h.digest()).decode()
    if algo == "CRC64NVME" and getattr(utils, "HAS_CRT", False):
        from awscrt import checksums
        crc = 0
        for c in chunks:
            crc = checksums.crc64nvme(c, crc)
        return base64.b64encode(crc.to_bytes(8, "big")).decode()
    if algo == "CRC32C":
        try:
            import crc32c
            crc = 0
            for c in chunks:
                crc = crc32c.crc32c(c, crc)
            return base64.b64encode(crc.to_bytes(4, "big")).decode()
        except ImportError:
            pass
    crc = 0  # CRC32, and stock moto's CRC32 fallback for the others
    for c in chunks:
        crc = binascii.crc32(c, crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


models.FakeMultipart.complete = _complete

_complete_upload = models.S3Backend.complete_multipart_upload
_completed = {}  # (bucket, upload id) -> key name, of uploads completed here
_completed_lock = threading.Lock()


def _complete_multipart_upload(self, bucket_name, multipart_id, body):
    # One complete at a time: a retry that arrives while the first attempt is
    # still assembling waits for it, then finds the upload completed.
    with _completed_lock:
        bucket = self.get_bucket(bucket_name)
        if multipart_id not in bucket.multiparts:
            name = _completed.get((bucket_name, multipart_id))
            if name is not None and name in bucket.keys:
                return bucket.keys[name]  # a retried complete: S3 answers 200 again
            raise exceptions.NoSuchUpload(upload_id=multipart_id)
        key = _complete_upload(self, bucket_name, multipart_id, body)
        if key is not None:
            _completed[(bucket_name, multipart_id)] = key.name
        return key


models.S3Backend.complete_multipart_upload = _complete_multipart_upload

# Content-MD5 and flexible checksums checked as S3 does (moto_md5.py).
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import moto_md5  # noqa: E402

moto_md5.install()

if __name__ == "__main__":
    from moto.server import main

    main(sys.argv[1:])
