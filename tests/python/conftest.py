"""Fixtures shared by the test modules of this folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def moto():
    """One local S3 server per module (tests/s3/moto_server.py, auth on: every
    request's SigV4 signature is verified); each test works below its own prefix."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "s3"))
    from moto_server import MotoServer

    with MotoServer(auth=True) as srv:
        yield srv
