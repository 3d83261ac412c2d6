"""moto's server with STS AssumeRoleWithWebIdentity as AWS serves it: unsigned.

With auth on (tests/s3/moto_server.py auth=True) moto wants every request
signed, but AssumeRoleWithWebIdentity is a public operation: the web identity
token is the caller's proof, and AWS answers it without a signature. Here that
one action skips moto's signature check and instead must carry the token in
CAIRN_TEST_WEB_IDENTITY_TOKEN (the stand-in for the OIDC provider's check,
which moto does not do): a wrong or missing token is 403 InvalidIdentityToken.
Everything else is stock moto, so the credentials it issues are the ones its
S3 then verifies signatures against.
"""
import os
import sys

from moto.core import authorization
from moto.core.exceptions import _RESTError as RESTError  # what moto's own auth errors use

_original = authorization.ActionAuthenticatorMixin._authenticate_and_authorize_action


class InvalidIdentityToken(RESTError):
    code = 403

    def __init__(self):
        super().__init__("InvalidIdentityToken", "the web identity token is not valid")


def _authenticate(self, iam_request_cls, resource="*"):
    try:
        action = self._get_action()
    except Exception:  # noqa: BLE001 - not an STS-style request
        action = None
    if action == "AssumeRoleWithWebIdentity":
        token = self._get_param("WebIdentityToken")
        if not token or token != os.environ.get("CAIRN_TEST_WEB_IDENTITY_TOKEN"):
            raise InvalidIdentityToken()
        return
    _original(self, iam_request_cls, resource)


authorization.ActionAuthenticatorMixin._authenticate_and_authorize_action = _authenticate

if __name__ == "__main__":
    from moto.server import main

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moto_md5  # S3's checksum checks, as moto_server.py's other servers have them

    moto_md5.install()
    main(sys.argv[1:])
