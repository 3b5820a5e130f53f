"""Every output fsdpfast writes on the test corpus is the one recorded (tests/data/recorded_outputs/).

The runs of tests/support/record_outputs.py (merges of each layout, dtypes, several files, the command line, two
torchrun processes, `verify --against`, `save_pretrained`, LoRA adapter folders and fused merges) are made
again with the code under test, and each file's sha256 (or, for the JSON files that depend on where the run
happened, its normalised JSON) must be the recorded one. There is a recording per corpus (the CPU a
corpus is trained on changes its last bits); each run is compared with the recording whose inputs are
the run's inputs here. A run no recording has the inputs of (another machine, torch or transformers
build) is skipped with that reason: its outputs could not be the same.

Regenerate the recording only on a commit whose outputs are the reference: `python tests/support/record_outputs.py`.
Set FSDPFAST_OUTPUTS_CORPUS=DIR to keep the corpus between runs (the first run writes it there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from record_outputs import (
    CORPUS_ENV,
    Corpus,
    Merge,
    Normaliser,
    folder_record,
    record,
    recordings,
    runs,
    written_corpus,
)

from fsdpfast.execute import runner
from fsdpfast.io.pread_sources import PreadSources

# Minutes of checks that need no particular torch build (docs/development.md)
pytestmark = pytest.mark.slow

RECORDINGS = recordings()
RUNS = list(RECORDINGS[0]["runs"])


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
    for recording in RECORDINGS:
        assert list(now["runs"]) == list(recording["runs"]), (
            "record_outputs.runs() changed: regenerate on the reference"
        )


@pytest.mark.parametrize("run", RUNS)
def test_the_outputs_are_the_recorded_ones(now, run):
    matching = [r for r in RECORDINGS if all(now["inputs"].get(n) == r["inputs"][n] for n in r["runs"][run]["inputs"])]
    if not matching:
        changed = [
            n for n in RECORDINGS[0]["runs"][run]["inputs"] if now["inputs"].get(n) != RECORDINGS[0]["inputs"][n]
        ]
        pytest.skip(
            f"no recording was made on this corpus ({', '.join(changed)} differ; recorded with "
            f"{RECORDINGS[0]['recorded_with']}): the outputs cannot be compared"
        )
    recorded = matching[0]["runs"][run]
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
    for name, run in RECORDINGS[0]["runs"].items()
    if name.startswith(("merge-", "lora-")) and "raised" not in (run["report"] or {})
]


@pytest.fixture(scope="module")
def corpus(root) -> Corpus:
    """The corpus `now` merged, or written here when only the tests below run."""
    folder = Path(os.environ.get(CORPUS_ENV) or root / "corpus")
    return Corpus(folder) if (folder / "fsdp2").exists() else written_corpus(folder)


@pytest.mark.parametrize("run", MERGES)
def test_the_merges_read_with_pread_write_what_mapped_ones_write(corpus, tmp_path, monkeypatch, run):
    """Every layout's merges of the recording again, the sources read with explicit preads
    (io.pread_sources) in batches of 4 KB (tensors cut in slices, reads a few batches ahead, pages shared between
    batches) and mapped: the same files, byte for byte (the mapped ones are the recorded ones where
    this corpus is the recorded one: the test above)."""
    found = {r.name: r for r in runs(corpus)}.get(run)
    if found is None or not isinstance(found.do, Merge):
        pytest.skip(f"{run} is not a merge in this process here")
    written = ("fsdp2", "fsdp1", "deepspeed", "lora", "live")  # the rest are committed (tests/fixtures)
    if not all((corpus.root / kind).exists() for kind in (n.split("/")[0] for n in found.inputs) if kind in written):
        pytest.skip(f"{run}: its inputs were not written here")
    files = {}
    for mode in ("mmap", "pread"):
        if mode == "pread":
            monkeypatch.setattr(runner, "BATCH_BYTES", 4096)
            monkeypatch.setattr(PreadSources, "ahead_bytes", 16384)  # a few batches announced ahead
        report = Merge(found.do.src, {**found.do.options, "read_mode": mode})(tmp_path / mode / run)
        assert (mode == "pread") == any("sources read with large parallel reads" in n for n in report.notes)
        files[mode] = folder_record(tmp_path / mode / run, Normaliser(corpus.root, tmp_path / mode))
    assert list(files["pread"]) == list(files["mmap"]), run
    for name, want in files["mmap"].items():
        difference = first_difference(want, files["pread"][name])
        assert difference is None, f"{run} read with pread: {name} differs from the mapped merge's: {difference}"
