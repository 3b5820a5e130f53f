"""FSDP1 LOCAL_STATE_DICT flat parameters, written by real FSDP1 on gloo ranks, merged bit for bit.

FSDP1 runs on the CPU when given `device_id=torch.device("cpu")`, so every checkpoint here
comes from FSDP1 itself (fsdpfast._testing.fsdp1_examples), and the reference is FSDP1's own
FULL_STATE_DICT of the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from corpus import DECODER_AND_MLP
from corpus import FSDP1_SPECS as SPECS
from helpers import CheckpointsByWorld, assert_bit_exact, load_reference, read_merged

import fsdpfast
from fsdpfast._parsing.safe_load import safe_unpickle
from fsdpfast._testing.fsdp1_examples import write_fsdp1_checkpoints
from fsdpfast.errors import BadInput, UnsafeCheckpoint

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class Fsdp1Checkpoints(CheckpointsByWorld):
    def __init__(self, root: str):
        super().__init__(root, SPECS, write_fsdp1_checkpoints, lambda spec, root: spec.folder(root))

    def copy(self, name: str, tmp_path) -> str:
        """A private copy to damage, the original left as it is."""
        return shutil.copytree(self.get(name)[1], tmp_path / "ckpt")

    def reference(self, name: str):
        return load_reference(SPECS[name][1].reference_path(self.root))


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory) -> Fsdp1Checkpoints:
    return Fsdp1Checkpoints(str(tmp_path_factory.mktemp("fsdp1")))


MERGED = [n for n in SPECS if n != "w2-verl-names"]


@pytest.mark.parametrize("name", MERGED)
def test_merge_is_bit_exact(fsdp1, tmp_path, name):
    spec, folder = fsdp1.get(name)
    report = fsdpfast.merge(folder, tmp_path / "out", wrap=list(spec.wrap) or None)  # none: the default wrap
    assert report.layout == "fsdp1-flat" and report.world_size == SPECS[name][0]
    reference, tied = fsdp1.reference(name)
    assert_bit_exact(read_merged(tmp_path / "out"), reference, tied=tied)
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["architectures"]


@pytest.mark.parametrize("name", ["w3-tied", "w3-bf16-orig"])
def test_merge_to_bf16_and_fp32(fsdp1, tmp_path, name):
    _, folder = fsdp1.get(name)
    reference, tied = fsdp1.reference(name)
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        fsdpfast.merge(folder, tmp_path / dtype, dtype=dtype)
        assert_bit_exact(read_merged(tmp_path / dtype), reference, torch_dtype, tied=tied)


@pytest.mark.parametrize("name", ["w3-orig", "w3-tied"])
def test_merge_to_fp8_is_the_anchors_quantization(fsdp1, tmp_path, name):
    """--dtype fp8 from FSDP1 flat shards (3 ranks: parameters cut unevenly): transformers' Fp8Quantize
    of the unsharded model's bf16 weights (tests/support/fp8_anchor.py); verify checks it."""
    from fp8_anchor import assert_fp8_is_the_anchors

    from fsdpfast import _ops

    if not _ops.torch_ops():
        pytest.skip(f"fsdpfast torch ops not built: {_ops.torch_ops_error()}")
    _, folder = fsdp1.get(name)
    reference, tied = fsdp1.reference(name)
    fsdpfast.merge(folder, tmp_path / "fp8", dtype="fp8")
    assert_fp8_is_the_anchors(read_merged(tmp_path / "fp8"), reference, tied)
    assert fsdpfast.verify(tmp_path / "fp8", against=folder).ok


@pytest.mark.parametrize("name", ["w3-mlp-units", "w2-root-only"])
def test_verify_against_the_checkpoint_uses_the_recorded_wrap(fsdp1, tmp_path, name):
    spec, folder = fsdp1.get(name)
    fsdpfast.merge(folder, tmp_path / "out", wrap=list(spec.wrap))
    report = fsdpfast.verify(tmp_path / "out", against=folder)
    assert report.ok and report.tensors, report.summary()


def test_use_orig_params_is_detected_and_can_be_given(fsdp1, tmp_path):
    _, plain = fsdp1.get("w3-tied")
    _, orig = fsdp1.get("w3-orig")
    assert fsdpfast.inspect(plain)["assumed"]["use_orig_params"] is False
    found = fsdpfast.inspect(orig)["assumed"]
    assert found["use_orig_params"] is True and found["alignment_elements"] == 4
    assert fsdpfast.inspect(fsdp1.get("w3-bf16-orig")[1])["assumed"]["alignment_elements"] == 8  # 16 bytes of bf16
    assert fsdpfast.inspect(plain, use_orig_params=False)["assumed"]["alignment_source"] == "use_orig_params=False"
    with pytest.raises(BadInput, match="use_orig_params=True; drop use_orig_params=False"):
        fsdpfast.inspect(orig, use_orig_params=False)
    with pytest.raises(BadInput, match="flattens to"):
        fsdpfast.inspect(plain, use_orig_params=True)


def test_inspect_shows_wrap_units_and_order(fsdp1):
    _, folder = fsdp1.get("w3-mlp-units")
    found = fsdpfast.inspect(folder, wrap=["LlamaDecoderLayer", "LlamaMLP"])
    assumed = found["assumed"]
    assert assumed["model"] == "LlamaForCausalLM" and assumed["wrap"] == list(DECODER_AND_MLP)
    units = {u["module"]: u for u in assumed["units"]}
    # post-order: a layer's MLP is its own unit, built before the layer that keeps attention and norms
    assert list(units)[:2] == ["model.layers.0.mlp", "model.layers.0"] and list(units)[-1] == "(root)"
    assert [p["name"] for p in units["model.layers.0.mlp"]["params"]] == [
        f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")
    ]
    assert units["model.layers.0"]["key"] == "model.layers.0._flat_param"
    assert all(u["padding"] == 0 for u in units.values())
    assert [p["name"] for p in units["(root)"]["params"]] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]


def test_the_transformers_the_order_came_from_is_noted_and_recorded(fsdp1, tmp_path):
    """Sizes cannot check the order of same-shaped parameters: where it came from is said and kept."""
    import transformers

    _, folder = fsdp1.get("w2-llama")
    origin = f"transformers {transformers.__version__} transformers.models.llama.modeling_llama.LlamaForCausalLM"
    found = fsdpfast.inspect(folder)
    assert found["assumed"]["order_from"] == origin
    assert any(
        origin in note and "compare the merged model's outputs with a reference" in note for note in found["notes"]
    )
    fsdpfast.merge(folder, tmp_path / "out")
    with open(tmp_path / "out" / "fsdpfast-manifest.json") as f:
        assert json.load(f)["layout_options"]["order_from"] == origin
    assert fsdpfast.verify(tmp_path / "out", against=folder).ok  # the recorded option is read back
    older = fsdpfast.plan_merge(folder, order_from="transformers 4.0.0 LlamaForCausalLM")
    assert any(n.startswith("the merge took that order from transformers 4.0.0") for n in older.notes)


def test_a_weight_tied_across_units_keeps_both_names(fsdp1):
    """An inner unit that takes a tied weight holds it once; the outer unit's name becomes its alias."""
    from fsdpfast.readers import fsdp1_units

    _, folder = fsdp1.get("w3-tied")
    model, _ = fsdp1_units.meta_model(os.path.join(folder, "huggingface"))
    units = {u.path: u for u in fsdp1_units.units(model, ["LlamaDecoderLayer", "Embedding"])}
    (embedding,) = units["model.embed_tokens"].params
    assert embedding.name == "model.embed_tokens.weight" and embedding.aliases == ("lm_head.weight",)
    assert "lm_head.weight" not in [p.name for p in units[""].params]
    same = {u.path: u for u in fsdp1_units.units(model, ["LlamaDecoderLayer"])}  # both in the root: as before
    assert [p.aliases for p in same[""].params if p.name == "model.embed_tokens.weight"] == [("lm_head.weight",)]


def test_only_model_classes_are_built(fsdp1, tmp_path):
    folder = fsdp1.copy("w2-llama", tmp_path)
    path = os.path.join(folder, "huggingface", "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = ["LlamaConfig"]  # a transformers class, not a model
    with open(path, "w") as f:
        json.dump(config, f)
    assert "architecture LlamaConfig is not a transformers model class" in _refused(folder, tmp_path / "out")


def test_inspect_cli_prints_the_assumptions(fsdp1):
    _, folder = fsdp1.get("w2-tied-orig")
    result = subprocess.run([sys.executable, "-m", "fsdpfast", "inspect", folder], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "assumed: model LlamaForCausalLM" in result.stdout and "wrap LlamaDecoderLayer" in result.stdout
    assert "unit (root) (LlamaForCausalLM): _flat_param" in result.stdout
    assert "model.embed_tokens.weight (101, 64)  (also lm_head.weight)" in result.stdout


def test_cli_merge_with_wrap_and_flag(fsdp1, tmp_path):
    _, folder = fsdp1.get("w4-bert")
    args = [
        sys.executable,
        "-m",
        "fsdpfast",
        "merge",
        folder,
        "--out",
        str(tmp_path / "out"),
        "--wrap",
        "BertLayer",
        "--no-use-orig-params",
    ]
    result = subprocess.run(args, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    reference, tied = fsdp1.reference("w4-bert")
    assert_bit_exact(read_merged(tmp_path / "out"), reference, tied=tied)


def test_two_plausible_layouts_need_layout(fsdp1, tmp_path):
    _, folder = fsdp1.get("w2-verl-names")  # verl's file names, FSDP1 flat parameters inside
    with pytest.raises(
        BadInput, match=r"several layouts \(fsdp-ranks, fsdp1-flat\); choose one with the layout argument"
    ):
        fsdpfast.merge(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(BadInput, match="is a ShardedTensor; FSDP1 flat parameters: read them with layout='fsdp1-flat'"):
        fsdpfast.merge(folder, tmp_path / "out", layout="fsdp-ranks")
    fsdpfast.merge(folder, tmp_path / "out", layout="fsdp1-flat")
    reference, tied = fsdp1.reference("w2-verl-names")
    assert_bit_exact(read_merged(tmp_path / "out"), reference, tied=tied)


def test_config_from_elsewhere(fsdp1, tmp_path):
    folder = fsdp1.copy("w2-llama", tmp_path)
    shutil.move(os.path.join(folder, "huggingface"), tmp_path / "config")
    with pytest.raises(BadInput, match="pass config=DIR"):
        fsdpfast.merge(folder, tmp_path / "out")
    fsdpfast.merge(folder, tmp_path / "out", config=tmp_path / "config")
    reference, tied = fsdp1.reference("w2-llama")
    assert_bit_exact(read_merged(tmp_path / "out"), reference, tied=tied)


# ---- bad input: one clear line, nothing written ----------------------------------------------


def _refused(folder, out, *extra) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", str(folder), "--out", str(out), *extra],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("fsdpfast: error: "), result.stderr
    assert not out.exists()
    return result.stderr


@pytest.mark.parametrize("rank", [0, 2])
def test_missing_rank(fsdp1, tmp_path, rank):
    folder = fsdp1.copy("w3-tied", tmp_path)
    os.remove(os.path.join(folder, f"pytorch_model_fsdp_rank{rank}.bin"))
    error = _refused(folder, tmp_path / "out")
    assert f"pytorch_model_fsdp_rank{rank}.bin is missing: a checkpoint of 3 ranks needs every rank's file" in error


@pytest.mark.parametrize("rank", [0, 1])
def test_truncated_rank_file(fsdp1, tmp_path, rank):
    folder = fsdp1.copy("w3-orig", tmp_path)
    path = os.path.join(folder, f"pytorch_model_fsdp_rank{rank}.bin")
    before = {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".bin")}
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    error = _refused(folder, tmp_path / "out")
    assert f"pytorch_model_fsdp_rank{rank}.bin" in error and "truncated" in error
    assert {f: os.path.getsize(os.path.join(folder, f)) for f in before if f != os.path.basename(path)} == {
        f: s for f, s in before.items() if f != os.path.basename(path)
    }


def test_rank_file_of_another_world_size(fsdp1, tmp_path):
    folder = fsdp1.copy("w3-tied", tmp_path)
    _, other = fsdp1.get("w2-llama")
    shutil.copy(
        os.path.join(other, "pytorch_model_fsdp_rank1.bin"), os.path.join(folder, "pytorch_model_fsdp_rank1.bin")
    )
    error = _refused(folder, tmp_path / "out")
    assert "rank1.bin" in error and "all rank files must come from one checkpoint" in error


def test_rank_file_copied_under_another_rank(fsdp1, tmp_path):
    folder = fsdp1.copy("w3-tied", tmp_path)
    shutil.copy(
        os.path.join(folder, "pytorch_model_fsdp_rank1.bin"), os.path.join(folder, "pytorch_model_fsdp_rank2.bin")
    )
    error = _refused(folder, tmp_path / "out")
    assert "saved by rank 1 of 3, but the file name says rank 2 of 3" in error


def _resplit_root(rank: int, world: int, port: int, folder: str) -> None:
    """Re-save rank files with the root's flat parameter split otherwise than FSDP1's ceil(n / world) pieces."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        path = os.path.join(folder, f"pytorch_model_fsdp_rank{rank}.bin")
        state = torch.load(path, weights_only=False)
        pieces = [None] * world
        dist.all_gather_object(pieces, [s.tensor for s in state["_flat_param"].local_shards()])
        whole = torch.cat([t for piece in pieces for t in piece])
        chunk = -(-len(whole) // world)  # FSDP1's piece; here rank 0 holds one element less, rank 1 one more
        sizes = [chunk - 1, chunk + 1] + [len(whole) - 2 * chunk]
        start = sum(sizes[:rank])
        local = whole[start : start + sizes[rank]].clone()
        shards = [Shard.from_tensor_and_offsets(local, [start], rank)]
        state["_flat_param"] = init_from_local_shards(shards, len(whole), process_group=dist.group.WORLD)
        torch.save(state, path)
    finally:
        dist.destroy_process_group()


def test_partition_sizes_other_than_fsdp1s(fsdp1, tmp_path):
    import torch.multiprocessing as mp

    from fsdpfast._testing.fsdp2_writer import _free_port

    folder = fsdp1.copy("w3-tied", tmp_path)  # 3 ranks: the sizes above
    mp.spawn(_resplit_root, args=(3, _free_port(), folder), nprocs=3, join=True)
    error = _refused(folder, tmp_path / "out")
    assert "pytorch_model_fsdp_rank0.bin: _flat_param: its shard holds [" in error
    assert "FSDP1's chunking of" in error and "over 3 ranks gives rank 0" in error


def test_wrong_wrap_suggests_the_files_units(fsdp1, tmp_path):
    _, folder = fsdp1.get("w3-mlp-units")
    error = _refused(folder, tmp_path / "out")  # default wrap: the decoder layer only
    assert "does not give FSDP1's units here" in error and "--wrap" in error
    assert "(the files' units are LlamaDecoderLayer, LlamaMLP)" in error
    error = _refused(fsdp1.get("w3-tied")[1], tmp_path / "out", "--wrap", "LlamaMLP")
    assert "(the files' units are LlamaDecoderLayer)" in error
    with pytest.raises(BadInput, match="wrap='GPT2Block': no module of that class in LlamaForCausalLM"):
        fsdpfast.inspect(folder, wrap="GPT2Block")
    with pytest.raises(BadInput, match=r"\(the files' units are the root only: wrap='none'\)"):
        fsdpfast.inspect(fsdp1.get("w2-root-only")[1])  # the default wraps the decoder layers


def test_flat_size_not_matching_the_model(fsdp1, tmp_path):
    """A config other than the trained model's: same units, other sizes -> the unit, both sizes, --wrap."""
    folder = fsdp1.copy("w2-llama", tmp_path)
    path = os.path.join(folder, "huggingface", "config.json")
    with open(path) as f:
        config = json.load(f)
    config["intermediate_size"] = 96
    with open(path, "w") as f:
        json.dump(config, f)
    error = _refused(folder, tmp_path / "out")
    assert "model.layers.0._flat_param holds" in error and "unit model.layers.0 of LlamaForCausalLM" in error
    assert "flattens to" in error and "--wrap" in error


def test_config_without_architectures(fsdp1, tmp_path):
    folder = fsdp1.copy("w2-llama", tmp_path)
    path = os.path.join(folder, "huggingface", "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["architectures"]
    with open(path, "w") as f:
        json.dump(config, f)
    assert 'has no "architectures" field' in _refused(folder, tmp_path / "out")


def test_fsdp1_options_on_other_layouts(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    with pytest.raises(BadInput, match="the wrap argument applies to fsdp1-flat"):
        fsdpfast.merge(folder, tmp_path / "out", wrap="LlamaDecoderLayer")


def test_getattr_only_for_sharded_tensor_state():
    """ShardedTensor pickles `getattr(ShardedTensor, "ProcessGroupState")`; any other getattr is refused."""
    for owner, name in (
        ("torch\nSize", b"__new__"),
        ("torch.distributed._shard.sharded_tensor.api\nShardedTensor", b"__class__"),
    ):
        payload = (
            b"\x80\x02c__builtin__\ngetattr\nc"
            + owner.encode()
            + b"\nX"
            + len(name).to_bytes(4, "little")
            + name
            + b"\x86R."
        )
        with pytest.raises(UnsafeCheckpoint, match="getattr"):
            safe_unpickle(payload, "evil.pkl")


@pytest.mark.torch_ops
@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="checks real FSDP1 on a GPU; the CPU runs above use real FSDP1 too"
)
def test_real_fsdp1_on_gpu(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fsdp1_real_check.py")
    result = subprocess.run(
        [sys.executable, script, "--device", "cuda", "--workdir", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
