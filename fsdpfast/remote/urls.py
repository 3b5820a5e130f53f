"""Which paths are object-store URLs, and the one-line refusal when the client is not installed."""

from __future__ import annotations

from ..errors import BadInput

SCHEMES = ("s3://", "gs://", "az://", "abfs://")
INSTALL = 'pip install "fsdpfast[s3]"'


def is_remote(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def split_url(url: str) -> tuple[str, str]:
    """('s3://bucket', 'key/prefix') of 's3://bucket/key/prefix/' (no slash at either end of the key)."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise BadInput(f"{url}: no bucket named; write it as {scheme}://BUCKET/PREFIX")
    return f"{scheme}://{bucket}", key.strip("/")


def require_client(url: str):
    """The obstore module, or a one-line refusal naming what to install."""
    try:
        import obstore
    except ImportError:
        raise BadInput(f"{url}: object-store paths need the obstore client; install it with {INSTALL}") from None
    return obstore
