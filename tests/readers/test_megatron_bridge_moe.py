"""The Megatron-Core MoE fixtures merge bit for bit to megatron-bridge's own export of the same checkpoint.

megatron-bridge 0.3.1 (tests/fixtures/make_megatron_checkpoints.py, export_moe_with_bridge) built each model at
TP1/PP1/EP1 with its own provider and mappings, its experts megatron-core's TEGroupedMLP (the layer bridge's MoE
mappings name: bridge cannot export SequentialMLP experts), loaded the checkpoint with dist_checkpointing.load
(resharding EP, expert TP and PP on load) and exported it with export_hf_weights, saved as bridge_export.safetensors.
What bridge 0.3.1 has no mapping for is recorded per fixture in versions.json with the reason; those tensors are
checked against the live weights in test_megatron.py. Mixtral has no bridge in 0.3.1. The TE-spec twins
(test_megatron_te_spec.py) were built for bridge with megatron-core's TE spec, bridge's providers' own default.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_bit_exact, read_merged
from safetensors.torch import load_file

import fsdpfast

pytestmark = pytest.mark.slow  # each merges a fixture (a second or so)

DATA = Path(__file__).parents[1] / "data" / "megatron"
VERSIONS = json.loads((DATA / "versions.json").read_text())
BRIDGED_MOE = VERSIONS["bridge_export_of_moe"]  # fixture -> {"not_exported": [...], "why": ...}


def test_every_moe_fixture_with_a_reference_has_bridges_export_but_mixtral():
    moe = {f["name"] for f in VERSIONS["fixtures"] if f["experts"]}
    with_reference = set(VERSIONS["reference_from_live_weights_only"]) | set(BRIDGED_MOE)
    assert set(BRIDGED_MOE) == {n for n in moe & with_reference if "mixtral" not in n}
    for name in BRIDGED_MOE:
        assert (DATA / name / "bridge_export.safetensors").is_file(), name


@pytest.mark.parametrize("name", sorted(BRIDGED_MOE))
def test_merges_bit_exact_to_megatron_bridges_export(tmp_path, name):
    fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf")
    merged = read_merged(str(tmp_path / "out"))
    exported = load_file(str(DATA / name / "bridge_export.safetensors"))
    not_exported = set(BRIDGED_MOE[name]["not_exported"])
    assert set(merged) - set(exported) == not_exported, sorted(set(merged) ^ set(exported))
    assert_bit_exact({k: v for k, v in merged.items() if k not in not_exported}, exported)
