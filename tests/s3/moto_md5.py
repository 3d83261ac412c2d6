"""moto's S3 server checking Content-MD5 as S3 does.

S3 refuses a PutObject or UploadPart whose body does not match its
Content-MD5 header (400 BadDigest) and stores nothing; moto 5.x ignores the
header and stores whatever arrived. ``install()`` adds S3's check in front of
moto's object requests, so a byte changed on the way (the fault proxy's
"flip") is refused by the server, as it would be by S3. Everything else is
stock moto.

Usage: ``python moto_md5.py -H 127.0.0.1 -p PORT`` (moto.server's arguments);
moto_ranged.py installs it too.
"""
import base64
import hashlib
import sys

from moto.s3 import responses

_BAD_DIGEST = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>BadDigest</Code>'
               b"<Message>The Content-MD5 you specified did not match what we received."
               b"</Message></Error>")


def install():
    if getattr(responses.S3Response.key_response, "_checks_md5", False):
        return
    inner = responses.S3Response.key_response

    def key_response(self, request, full_url, headers):
        want = request.headers.get("Content-MD5")
        if want and request.method in ("PUT", "POST"):
            got = base64.b64encode(hashlib.md5(request.get_data()).digest()).decode()
            if got != want.strip():
                return 400, {"Content-Type": "application/xml"}, _BAD_DIGEST
        return inner(self, request, full_url, headers)

    key_response._checks_md5 = True
    responses.S3Response.key_response = key_response


if __name__ == "__main__":
    from moto.server import main

    install()
    main(sys.argv[1:])
