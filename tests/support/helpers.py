"""Assertions shared by the tests: bit-for-bit comparison with the unsharded model."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def read_merged(out_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a merged folder, each file opened with safetensors.safe_open."""
    tensors = {}
    files = sorted(glob.glob(os.path.join(out_dir, "*.safetensors")))
    assert files, f"no safetensors files in {out_dir}"
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} written twice"
                tensors[name] = f.get_tensor(name)
    return tensors


def clean(name: str) -> str:
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def load_reference(path: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(unsharded state dict, names tied to an earlier parameter), wrapper parts removed."""
    saved = torch.load(path, weights_only=True)
    return {clean(k): v for k, v in saved["state_dict"].items()}, {clean(k) for k in saved["tied"]}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_bit_exact(
    merged: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], dtype: torch.dtype | None = None, tied=()
) -> None:
    """merged == reference (cast with .to(dtype) for floating tensors), tied names absent."""
    expected_names = set(reference) - set(tied)
    assert set(merged) == expected_names, sorted(set(merged) ^ expected_names)
    for name in expected_names:
        want = reference[name]
        if dtype is not None and want.is_floating_point():
            want = want.to(dtype)
        got = merged[name]
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert torch.equal(bits(got), bits(want)), f"{name} differs"


def transformers_logits(out_dir: str, model_kind: str, dtype: str = "float32") -> torch.Tensor:
    """Logits of the merged folder loaded with from_pretrained, on the FSDP2 writer's probe input.

    The training side built its model in float32 and then called .to(dtype), which also casts
    non-persistent buffers (rotary frequencies); loading in float32 and casting the same way
    reproduces that model exactly (bfloat16 -> float32 -> bfloat16 is lossless for weights).
    """
    import transformers

    from fsdpfast._testing.fsdp2_writer import PROBE_INPUT

    cls = transformers.BertForMaskedLM if model_kind == "bert" else transformers.LlamaForCausalLM
    torch.set_num_threads(1)
    model = cls.from_pretrained(out_dir, dtype=torch.float32).to(getattr(torch, dtype))
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE_INPUT)).logits


def read_index(out_dir: str) -> dict:
    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
        return json.load(f)


def copy_checkpoint(checkpoints, name: str, tmp_path: Path) -> Path:
    """A private copy of a session checkpoint, to damage without touching the original."""
    _, folder = checkpoints.get(name)
    return Path(shutil.copytree(folder, tmp_path / "ckpt"))


def config_beside(folder: Path) -> list[str]:
    """Move huggingface/'s files up, beside the checkpoint files (config.json next to DCP's .metadata); their names."""
    moved = sorted(p.name for p in (folder / "huggingface").iterdir())
    for name in moved:
        shutil.move(folder / "huggingface" / name, folder / name)
    (folder / "huggingface").rmdir()
    return moved


def rank_file(folder: Path, rank: int) -> Path:
    (path,) = folder.glob(f"*_rank_{rank}.pt")
    return path


class CheckpointsByWorld:
    """Test checkpoints written on first use: every spec of one world size at once, by one spawned
    process group. `specs`: name -> (world size, spec); `write(root, specs, world)`; `folder_of(spec, root)`."""

    def __init__(self, root: str, specs: dict, write, folder_of):
        self.root = root
        self._specs, self._write, self._folder_of = specs, write, folder_of
        self._written: set[int] = set()

    def get(self, name: str):
        """(spec, checkpoint folder); writes the world size's checkpoints on first use."""
        world, spec = self._specs[name]
        if world not in self._written:
            self._write(self.root, [s for w, s in self._specs.values() if w == world], world)
            self._written.add(world)
        return spec, self._folder_of(spec, self.root)


def write_many_ranks(folder: str, world_size: int, seed: int) -> str:
    """A tiny model's verl-style checkpoint of `world_size` rank files (fsdpfast._testing.many_ranks:
    real FSDP2 metadata over torch's fake process group, seeded values)."""
    command = ["-m", "fsdpfast._testing.many_ranks", folder, "--model", "tiny", "--world-size", str(world_size)]
    command += ["--data", "values", "--seed", str(seed)]
    subprocess.run([sys.executable, *command], check=True, timeout=900, capture_output=True)
    return folder


SAVE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}


def assert_holds_tied_once(written, reference, tied: dict[str, list[str]], save_dtype: str | None) -> None:
    """A live save's tensors are the reference's (the model's own full state dict) bit for bit, floats
    cast to `save_dtype`; tied names written once, under the kept name, whose bytes each alias holds."""
    dtype = SAVE_DTYPES[save_dtype]
    aliases = {alias: kept for kept, names in tied.items() for alias in names}
    assert_bit_exact(written, reference, dtype, tied=aliases)
    for alias, kept in aliases.items():
        want = (
            reference[alias].to(dtype)
            if dtype is not None and reference[alias].is_floating_point()
            else reference[alias]
        )
        assert torch.equal(bits(written[kept]), bits(want)), alias


def assert_an_offline_merges_files(folder: Path, spec, out: Path) -> None:
    """The live folder's weight files are byte for byte those the offline merge of the same model's
    rank files (folder/ckpt) writes, with the spec's dtype and file size; split where it asks."""
    import fsdpfast

    fsdpfast.merge(folder / "ckpt", out, dtype=spec.save_dtype or "keep", max_shard_size=spec.max_shard_size)
    weights = assert_same_weight_files(folder / "live", out)
    if spec.max_shard_size != "5GB":
        assert len([w for w in weights if w.endswith(".safetensors")]) > 1  # the split (the order) is tested too


def live_outcomes(folder, world: int) -> list[dict]:
    """How each rank's save_pretrained call ended (fsdpfast._testing.live_examples writes outcome-{rank}.json)."""
    return [json.loads((Path(folder) / f"outcome-{rank}.json").read_text()) for rank in range(world)]


def assert_same_weight_files(written, merged) -> list[str]:
    """The safetensors files and index of two folders, the same names and bytes; their names."""

    def weights(folder) -> list[str]:
        return sorted(p.name for p in Path(folder).iterdir() if p.name.endswith((".safetensors", ".index.json")))

    names = weights(written)
    assert names == weights(merged)
    for name in names:
        assert (Path(written) / name).read_bytes() == (Path(merged) / name).read_bytes(), name
    return names


def assert_loads_as_written(folder) -> None:
    """The folder verifies, and transformers loads it with the bytes it holds."""
    import transformers

    from fsdpfast import verify

    assert verify(folder).ok
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    written = read_merged(folder)
    for key, value in model.state_dict().items():
        if key in written:
            assert torch.equal(value, written[key]), key


def assert_nothing_published(folder, world: int, failed_rank: int) -> None:
    """Every rank's save_pretrained failed, rank 0's message names the rank that failed, and neither
    the output nor a staging folder is left in `folder`."""
    results = live_outcomes(folder, world)
    assert not any(o["ok"] for o in results), results
    assert f"rank {failed_rank}" in results[0]["error"] and "nothing was published" in results[0]["error"], results[0]
    assert not (Path(folder) / "live").exists()
    assert not [p for p in Path(folder).iterdir() if p.name.startswith(".live")], list(Path(folder).iterdir())


def tiny_tokenizer():
    """A real fast tokenizer (two words), whose save_pretrained writes its files into the output."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocabulary), unk_token="<unk>")


def assert_folder_is_anchor(out_dir, anchor_dir) -> None:
    """OUT holds save_pretrained's tensors (ANCHOR_DIR's) bit for bit, loads with from_pretrained with no
    missing, unexpected or mismatched key and computes the anchor model's logits (a causal LM's)."""
    import transformers

    merged, want = read_merged(out_dir), read_merged(anchor_dir)
    assert sorted(merged) == sorted(want), sorted(set(merged) ^ set(want))
    for key, value in want.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    trained = transformers.AutoModelForCausalLM.from_pretrained(anchor_dir)
    for loaded in (model, trained):  # mapped from their files: the same alignment for both products
        for parameter in loaded.parameters():
            parameter.data = parameter.data.clone()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, trained.eval()(input_ids=ids).logits)
