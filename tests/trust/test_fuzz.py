"""The short fuzz run: every metadata parser on a few hundred mutated real files (fuzz_parsers.py).

Derandomized, so a failure here reproduces; the long run (`python tests/support/fuzz_parsers.py
--minutes N`) explores with fresh seeds.
"""

from __future__ import annotations

import pytest
from fuzz_parsers import (
    DEEPSPEED_SEED,
    FSDP1_SEED,
    READER_TARGETS,
    SEED_CHECKPOINTS,
    Seeds,
    Targets,
    deepspeed_tag_folder,
    install_hang_alarm,
    run_target,
    strategies,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLES = {
    "unpickle": 300,
    "pickle_opcodes": 300,
    "unpicklers_agree": 300,
    "unpicklers_agree_opcodes": 300,
    "twins": 300,
    "torch_zip": 150,
    "dcp_metadata": 100,
    "safetensors": 100,
    "merge": 60,
    "verify": 100,
    "verify_header": 100,
    "verify_manifest": 100,
}
READER_EXAMPLES = {"deepspeed_optim": 100, "fsdp1_rank": 60, "dcp_hf_header": 100}


@pytest.fixture(scope="module")
def seeds(checkpoints) -> Seeds:
    return Seeds.from_folders({name: checkpoints.get(name)[1] for name in SEED_CHECKPOINTS})


@pytest.mark.parametrize("target", EXAMPLES)
def test_parser_raises_only_clean_errors(seeds, tmp_path, target):
    install_hang_alarm()
    targets = Targets(seeds, tmp_path)
    run_target(targets, target, strategies(seeds)[target], EXAMPLES[target])
    assert targets.examples >= EXAMPLES[target] // 2  # hypothesis really ran it


@pytest.fixture(scope="module")
def fsdp1_seed(tmp_path_factory) -> str:
    from corpus import FSDP1_SPECS as SPECS

    from fsdpfast._testing.fsdp1_examples import write_fsdp1_checkpoints

    root = str(tmp_path_factory.mktemp("fsdp1-seed"))
    world, spec = SPECS[FSDP1_SEED]
    write_fsdp1_checkpoints(root, [spec], world)
    return spec.folder(root)


def _reader_seed(request, target: str) -> str:
    if target == "deepspeed_optim":  # skips where deepspeed is not installed, as the DeepSpeed tests do
        return deepspeed_tag_folder(request.getfixturevalue("deepspeed_checkpoints").get(DEEPSPEED_SEED)[1])
    if target == "fsdp1_rank":
        return request.getfixturevalue("fsdp1_seed")
    return request.getfixturevalue("checkpoints").get(READER_TARGETS[target][0])[1]


@pytest.mark.parametrize("target", READER_EXAMPLES)
def test_reader_raises_only_clean_errors(seeds, tmp_path, request, target):
    seeds.add_reader_seed(target, _reader_seed(request, target))
    install_hang_alarm()
    targets = Targets(seeds, tmp_path)
    run_target(targets, target, strategies(seeds)[target], READER_EXAMPLES[target])
    assert targets.examples >= READER_EXAMPLES[target] // 2
