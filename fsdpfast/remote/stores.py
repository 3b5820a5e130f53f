"""The store behind a URL, configured as obstore and the AWS tools read it (AWS_* variables including
AWS_ENDPOINT_URL, the instance's metadata), plus --storage-option KEY=VALUE. Nothing here is printed:
credentials stay in the client."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

from .urls import require_client, split_url

# Transient errors (5xx, dropped connections, timeouts) retried by the client with exponential backoff
# and jitter: 100 ms doubling to 5 s, ten tries (about 25 s: a store restarting is waited for), given up
# after 60 s (then the merge fails, nothing published). The client's abort of a multipart upload has the
# same retries and cannot be tried again after them (obstore 0.12): the clean-up outlasts no longer outage.
RETRIES = {
    "max_retries": 10,
    "retry_timeout": timedelta(seconds=60),
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5), "base": 2},
}
_OPTIONS: dict[str, str] = {}  # --storage-option pairs, set once by the command line
_STORES: dict[str, object] = {}
_LOCK = threading.Lock()


def set_storage_options(pairs: list[str]) -> None:
    """KEY=VALUE pairs (obstore's configuration keys: endpoint, region, skip_signature, ...)."""
    from ..errors import BadInput

    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BadInput(f"--storage-option {pair.split('=')[0]!r}: write it as KEY=VALUE")
        _OPTIONS[key.strip().lower()] = value
    _STORES.clear()


def store_for(url: str):
    """(the store of the URL's bucket, the key prefix inside it); one store per bucket, shared."""
    obstore = require_client(url)
    bucket, key = split_url(url)
    with _LOCK:
        store = _STORES.get(bucket)
        if store is None:
            store = obstore.store.from_url(
                bucket, config=_config(bucket), client_options=_client_options(), retry_config=RETRIES
            )
            _STORES[bucket] = store
    return store, key


def get_pinned(store, key: str, start: int, end: int, etag: str | None):
    """obstore's GetResult of bytes [start, end) of `key`, pinned to `etag` (None: unpinned). If-Match asks the
    store to refuse any other version; the response's own ETag is compared as well, since not every server
    evaluates If-Match (fake-gcs-server, a GCS emulator, serves the new object). Another version raises
    obstore's PreconditionError, as a store's refusal does."""
    import obstore
    from obstore.exceptions import PreconditionError

    options = {"range": (start, end)}
    if etag is not None:
        options["if_match"] = etag
    got = obstore.get(store, key, options=options)
    served = got.meta.get("e_tag")
    if etag is not None and served is not None and _bare(served) != _bare(etag):
        raise PreconditionError(f"{key}: ETag {served} where {etag} was pinned")
    return got


def _bare(etag: str) -> str:
    """An ETag without its quotes (and weak mark): listings and GET headers of one object differ so on some
    servers (Azure, fake-gcs-server list it bare, the GET header quotes it)."""
    return etag.removeprefix("W/").strip('"')


def _config(bucket: str) -> dict:
    config = {}
    if bucket.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            config["endpoint"] = endpoint
    config.update({k: v for k, v in _OPTIONS.items() if not k.startswith("client.")})
    return config


def _client_options() -> dict:
    options = {k.removeprefix("client."): v for k, v in _OPTIONS.items() if k.startswith("client.")}
    endpoint = _OPTIONS.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL", "")
    if endpoint.startswith("http://"):
        options.setdefault("allow_http", True)  # a local S3-compatible server
    return options
