"""Every output fsdpfast writes on the test corpus is the one recorded (tests/data/recorded_outputs.json).

The runs of tests/support/record_outputs.py (merges of each layout, dtypes, several files, the command line, two
torchrun processes, `verify --against`, `save_pretrained`, LoRA adapter folders and fused merges) are made
again with the code under test, and each file's sha256 (or, for the JSON files that depend on where the run
happened, its normalised JSON) must be the recorded one. A run whose inputs differ from the recorded ones
(another torch or transformers build) is skipped with that reason: its outputs could not be the same.

Regenerate the recording only on a commit whose outputs are the reference: `python tests/support/record_outputs.py`.
Set FSDPFAST_OUTPUTS_CORPUS=DIR to keep the corpus between runs (the first run writes it there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from record_outputs import CORPUS_ENV, RECORDED, Corpus, Merge, Normaliser, folder_record, record, runs

# Minutes of checks that need no particular torch build (docs/development.md)
pytestmark = pytest.mark.slow

RECORDING = json.loads(RECORDED.read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("outputs")


@pytest.fixture(scope="module")
def now(root) -> dict:
    return record(root)


def first_difference(recorded, found, where: str = "") -> str | None:
    """Where two recorded values first differ (a key path), key order included; None when they are the same."""
    if isinstance(recorded, dict) and isinstance(found, dict):
        if list(recorded) != list(found):
            missing, extra = sorted(set(recorded) - set(found)), sorted(set(found) - set(recorded))
            return f"{where or '/'}: keys missing {missing}, not recorded {extra}, or in another order"
        for key in recorded:
            found_at = first_difference(recorded[key], found[key], f"{where}/{key}")
            if found_at:
                return found_at
        return None
    if isinstance(recorded, list) and isinstance(found, list) and len(recorded) == len(found):
        for i, (a, b) in enumerate(zip(recorded, found)):
            found_at = first_difference(a, b, f"{where}[{i}]")
            if found_at:
                return found_at
        return None
    if recorded != found or type(recorded) is not type(found):
        return f"{where or '/'}: recorded {json.dumps(recorded)[:300]}, now {json.dumps(found)[:300]}"
    return None


def test_the_same_runs_are_made(now):
    assert list(now["runs"]) == list(RECORDING["runs"]), "record_outputs.runs() changed: regenerate on the reference"


@pytest.mark.parametrize("run", list(RECORDING["runs"]))
def test_the_outputs_are_the_recorded_ones(now, run):
    recorded = RECORDING["runs"][run]
    changed = [name for name in recorded["inputs"] if now["inputs"].get(name) != RECORDING["inputs"][name]]
    if changed:
        pytest.skip(
            f"the corpus itself differs from the recorded one ({', '.join(changed)}; recorded with "
            f"{RECORDING['recorded_with']}): the outputs cannot be compared"
        )
    found = now["runs"][run]
    report_difference = first_difference(recorded["report"], found["report"], "report")
    assert list(found["files"]) == list(recorded["files"]), (
        f"{run}: files not recorded {sorted(set(found['files']) - set(recorded['files']))}, "
        f"missing {sorted(set(recorded['files']) - set(found['files']))} ({report_difference or 'report as recorded'})"
    )
    for name, want in recorded["files"].items():
        difference = first_difference(want, found["files"][name])
        assert difference is None, f"{run}: {name} differs from the recorded one: {difference}"
    assert report_difference is None, f"{run}: {report_difference}"


MERGES = [
    name
    for name, run in RECORDING["runs"].items()
    if name.startswith(("merge-", "lora-")) and "raised" not in (run["report"] or {})
]


@pytest.mark.parametrize("run", MERGES)
def test_the_merges_read_with_pread_write_the_recorded_files(now, root, tmp_path, run):
    """Every layout's merges again, the sources read with explicit preads instead of mapped
    (io.pread_sources): the same files, byte for byte, as the recorded (mapped) merges."""
    recorded = RECORDING["runs"][run]
    if any(now["inputs"].get(name) != RECORDING["inputs"][name] for name in recorded["inputs"]):
        pytest.skip("the corpus itself differs from the recorded one: the outputs cannot be compared")
    corpus = Corpus(Path(os.environ.get(CORPUS_ENV) or root / "corpus"))  # the one `now` merged
    found = {r.name: r for r in runs(corpus)}[run]
    if not isinstance(found.do, Merge):
        pytest.skip(f"{run} is not a merge in this process")
    report = Merge(found.do.src, {**found.do.options, "read_mode": "pread"})(tmp_path / run)
    assert "sources read with large parallel reads (--read-mode pread)" in report.notes
    files = folder_record(tmp_path / run, Normaliser(corpus.root, tmp_path))
    assert list(files) == list(recorded["files"]), run
    for name, want in recorded["files"].items():
        difference = first_difference(want, files[name])
        assert difference is None, f"{run} read with pread: {name} differs from the recorded one: {difference}"
