"""torchtitan's step folders merged to the Hub's names (families.torchtitan), equal to torchtitan's own `to_hf`.

Checkpoints: torchtitan 0.3's own tiny llama3, qwen3 (dense and MoE) and deepseek_v3 models, sharded by FSDP2 on
gloo ranks and saved by its CheckpointManager (fsdpfast._testing.torchtitan_models); the anchor is
torchtitan's state-dict adapter (`to_hf`) of the unsharded state dict, names, dtypes and bytes.
torchtitan's model code imports triton, so these skip where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import read_merged
from refusals import api_refuses, cli_refuses

import fsdpfast
from fsdpfast.families.torchtitan_names import permuted_rows
from fsdpfast.plan.model import Extent, TensorPlan

needs_titan_models = pytest.mark.skipif(
    not (importlib.util.find_spec("torchtitan") and importlib.util.find_spec("triton")),
    reason="torchtitan's model code needs torchtitan and triton",
)
FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")


def _adapter(family: str):
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from fsdpfast._testing.torchtitan_models import titan_config

    adapter = {
        "llama3": Llama3StateDictAdapter,
        "qwen3": Qwen3StateDictAdapter,
        "qwen3_moe": Qwen3StateDictAdapter,
    }.get(family, DeepSeekV3StateDictAdapter)
    return adapter(titan_config(family), None)


class _Titan:
    def __init__(self, root):
        from fsdpfast._testing.torchtitan_models import TitanSpec, hf_config, write_titan_checkpoints

        self.root, self.specs = root, {f: TitanSpec(f, f, seed=60 + i) for i, f in enumerate(FAMILIES)}
        write_titan_checkpoints(str(root), list(self.specs.values()), 2)
        for family in FAMILIES:
            hf_config(family).save_pretrained(root / f"{family}-hf")

    def folder(self, family: str) -> str:
        return self.specs[family].folder(str(self.root))

    def config(self, family: str):
        return self.root / f"{family}-hf"

    def to_hf(self, family: str) -> dict:
        return _adapter(family).to_hf(torch.load(self.specs[family].reference_path(str(self.root))))


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    return _Titan(tmp_path_factory.mktemp("torchtitan"))


def _assert_equal(merged: dict, anchor: dict) -> None:
    assert sorted(merged) == sorted(anchor)
    for name, want in anchor.items():
        got = merged[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


@needs_titan_models
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_step_folder_merged_as_torchtitans_to_hf(titan, tmp_path, family):
    import transformers

    out = tmp_path / "merged"
    report = fsdpfast.merge(titan.folder(family), out, config=titan.config(family))
    _assert_equal(read_merged(out), titan.to_hf(family))
    assert any(f"torchtitan's {family.split('_moe')[0]} adapter" in note for note in report.notes), report.notes
    assert not report.warnings, report.warnings
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info
    # deepseek_v3's multi-token prediction layer: to_hf writes it after the main layers, as the Hub does,
    # where transformers builds none (it ignores the real model's layer 61 on load)
    mtp = {k for k in info["unexpected_keys"] if not k.startswith("model.layers.2.")}
    assert not mtp and (family == "deepseek_v3") == bool(info["unexpected_keys"]), info


@needs_titan_models
@pytest.mark.slow
@pytest.mark.distributed
def test_torchtitan_022_names_and_no_config(titan, tmp_path):
    """0.2.2's names (attention.wq, output) in a DCP folder torch writes; without --config, a warning."""
    import torch.distributed.checkpoint as dcp

    native = torch.load(titan.specs["llama3"].reference_path(str(titan.root)))
    old = {
        k.replace("attention.qkv_linear.", "attention.").replace("lm_head.weight", "output.weight"): v
        for k, v in native.items()
    }
    dcp.save(old, checkpoint_id=str(tmp_path / "step-5"))
    fsdpfast.merge(tmp_path / "step-5", tmp_path / "merged", config=titan.config("llama3"))
    _assert_equal(read_merged(tmp_path / "merged"), titan.to_hf("llama3"))

    report = fsdpfast.merge(titan.folder("llama3"), tmp_path / "as-is")
    assert any("not a Hugging Face model" in w and "torchtitan" in w for w in report.warnings), report.warnings
    assert sorted(read_merged(tmp_path / "as-is")) == sorted(native)


@needs_titan_models
@pytest.mark.slow
@pytest.mark.distributed
def test_a_family_without_a_map_is_refused(titan, tmp_path):
    config = json.loads((titan.config("llama3") / "config.json").read_text())
    other = tmp_path / "mistral"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    cli_refuses(titan.folder("llama3"), tmp_path / "out", "--config", other, mentions=("'mistral'", "--config"))
    # a config of another mapped family: its map has no name for llama3's tensors
    api_refuses(titan.folder("llama3"), tmp_path / "out", config=titan.config("deepseek_v3"), mentions=("torchtitan",))


@needs_titan_models
@pytest.mark.slow
def test_tied_embeddings_written_once_as_to_hf_does(tmp_path):
    """torchtitan's enable_weight_tying (llama3 1B and 3B): to_hf drops lm_head; config.json says tied."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from fsdpfast._testing.torchtitan_models import hf_config, titan_config

    config = dataclasses.replace(titan_config("llama3"), enable_weight_tying=True)
    torch.manual_seed(5)
    model = config.build()
    model.init_states()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(tmp_path / "step-1"))
    hf = hf_config("llama3")
    hf.tie_word_embeddings = True
    hf.save_pretrained(tmp_path / "hf")
    fsdpfast.merge(tmp_path / "step-1", tmp_path / "merged", config=tmp_path / "hf")
    want = type(_adapter("llama3"))(config, None).to_hf(state)
    assert "lm_head.weight" not in want
    _assert_equal(read_merged(tmp_path / "merged"), want)


@pytest.mark.parametrize("pieces", [1, 3])
def test_rope_permutation_windows_are_torchtitans_formula(pieces):
    """permuted_rows over a tensor in `pieces` row pieces (FSDP's Shard(0)) equals
    `w.view(n, rows // n // 2, 2, cols).transpose(1, 2).reshape(rows, cols)` (families.md §2.3)."""
    heads, head_dim, cols = 4, 8, 6
    rows = heads * head_dim
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(7))
    bounds = [round(i * rows / pieces) for i in range(pieces + 1)]
    buffers = [w[a:b].flatten() for a, b in zip(bounds, bounds[1:])]
    extents = [Extent(i, 0, (b - a) * cols, a * cols) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    plan = permuted_rows(TensorPlan("wq", (rows, cols), "float32", "float32", extents), "q_proj", heads)
    assert plan.name == "q_proj" and plan.shape == (rows, cols)
    out = torch.full((rows * cols,), float("nan"))
    for e in plan.extents:
        for r in range(e.runs):
            src, dst = e.src_offset + r * e.src_stride, e.dst_offset + r * e.dst_stride
            out[dst : dst + e.count] = buffers[e.source][src : src + e.count]
    want = w.view(heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    assert torch.equal(out.view(rows, cols), want)
    assert len(plan.extents) <= 2 * heads * pieces  # strided rows: a few extents per head, not one per row
