"""The short fuzz run: every metadata parser on a few hundred mutated real files (fuzz_parsers.py).

Derandomized, so a failure here reproduces; the long run (`python tests/fuzz_parsers.py
--minutes N`) explores with fresh seeds.
"""
from __future__ import annotations

import pytest

from fuzz_parsers import SEED_CHECKPOINTS, Seeds, Targets, install_hang_alarm, run_target, strategies

EXAMPLES = {"unpickle": 300, "pickle_opcodes": 300, "torch_zip": 150, "dcp_metadata": 100, "safetensors": 100, "merge": 60, "verify": 100,
            "verify_header": 100, "verify_manifest": 100}


@pytest.fixture(scope="module")
def seeds(checkpoints) -> Seeds:
    return Seeds.from_folders({name: checkpoints.get(name)[1] for name in SEED_CHECKPOINTS})


@pytest.mark.parametrize("target", EXAMPLES)
def test_parser_raises_only_clean_errors(seeds, tmp_path, target):
    install_hang_alarm()
    targets = Targets(seeds, tmp_path)
    run_target(targets, target, strategies(seeds)[target], EXAMPLES[target])
    assert targets.examples >= EXAMPLES[target] // 2  # hypothesis really ran it
