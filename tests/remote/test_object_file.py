"""An output object written by byte ranges keeps the bytes it was given, whatever the caller does with its
buffer afterwards (obstore 0.12's writer holds a reference to what it is handed until that part is sent)."""

from __future__ import annotations

import obstore
import pytest

from fsdpfast.remote.object_target import ObjectTarget

pytestmark = pytest.mark.slow  # the session's S3 server


def test_a_buffer_reused_after_write_at_does_not_change_the_object(s3_server, bucket):
    target = ObjectTarget(f"s3://{bucket}/out", overwrite=False)
    file = target.open("pieces.bin", 3000)
    buffer = bytearray(b"a" * 1000)
    file.write_at(buffer, 0)  # streamed at once (the next offset owed)
    buffer[:] = b"b" * 1000
    file.write_at(memoryview(buffer), 2000)  # beyond a gap: held until the gap is filled
    buffer[:] = b"c" * 1000
    file.write_at(buffer, 1000)
    buffer[:] = b"d" * 1000  # what a transposed tensor's next matrix does to its one buffer
    file.sync()
    written = bytes(obstore.get(target.store, target.key("pieces.bin")).bytes())
    assert written == b"a" * 1000 + b"c" * 1000 + b"b" * 1000
