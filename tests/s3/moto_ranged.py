"""moto's S3 server with ranged GETs that read only the range (bench/s3.py).

Stock moto (5.x) materializes the whole object for every GET and then slices
the requested range out of it: a ranged GET of 8 MiB from a 1 GB object reads
1 GB (from a spooled temp file) and holds a 1 GB copy while it does. With 16
ranged GETs in flight that is 16 GB of transient memory, and the cost of a
load grows with (object size x number of requests) instead of bytes moved,
which no real S3 server does. This launcher patches that one path: when a GET
carries a Range header, the object's value is a lazy view whose slice reads
just the range. Everything else is stock moto. Every peer of the benchmark
talks to the same patched server.

Usage: ``python moto_ranged.py -H 127.0.0.1 -p PORT`` (moto.server's arguments).
"""
import sys
import threading

from moto.s3 import models, responses

_local = threading.local()
_value = models.FakeKey.value


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


models.FakeKey.value = property(_value_get, _value.fset)
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

if __name__ == "__main__":
    from moto.server import main

    main(sys.argv[1:])
