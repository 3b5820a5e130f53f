"""The session's S3 server (tests/support/s3_server.py) and the environment a merge reads its endpoint
and credentials from, as the AWS tools do."""

from __future__ import annotations

import os
import uuid

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

from s3_server import S3Server  # noqa: E402


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    server.start()
    saved = {
        k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")
    }
    os.environ.update(
        AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_REGION="us-east-1"
    )
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def bucket(s3_server):
    """A new bucket per test: its name."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name
