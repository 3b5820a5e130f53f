"""The suite's own layout: every reader in the registry has its test file, named after it."""

from __future__ import annotations

from pathlib import Path

from fsdpfast.readers import READERS

READER_TESTS = Path(__file__).parent / "readers"


def test_every_reader_has_its_test_file():
    expected = {f"test_{name.replace('-', '_')}.py" for name in READERS}
    missing = sorted(name for name in expected if not (READER_TESTS / name).is_file())
    assert not missing, f"readers without a test file in tests/readers/: {missing}"
