"""The session corpus: real FSDP2 / DCP checkpoints the tests merge, by name, and the merge every
reader's test file runs on the corpus entries of its layout."""

from __future__ import annotations

import torch
from helpers import assert_bit_exact, load_reference, read_merged, transformers_logits

import fsdpfast
from fsdpfast._testing.fsdp1_examples import Fsdp1Spec
from fsdpfast._testing.fsdp2_writer import CheckpointSpec

# name -> (world size, spec). Sizes are tiny; uneven splits are on purpose (vocab 101 over
# 3 or 8 ranks, BERT's 2 token-type rows leave trailing ranks empty).
SPECS: dict[str, tuple[int, CheckpointSpec]] = {}


def _add(world: int, spec: CheckpointSpec) -> None:
    SPECS[spec.name] = (world, spec)


_add(1, CheckpointSpec("w1-plain", fsdp=False))
_add(1, CheckpointSpec("w1-dtensor-tied", model="llama-tied"))
_add(2, CheckpointSpec("w2-llama", seed=1))
_add(2, CheckpointSpec("w2-tied-bf16", model="llama-tied", dtype="bfloat16", seed=2))
_add(2, CheckpointSpec("w2-guide", layout="guide-ranks", seed=3))
# Plain to_local() pieces are placed by the model's shapes: config.json names the class.
_add(2, CheckpointSpec("w2-guide-local", layout="guide-ranks-local", architecture=True, second_save=True, seed=4))
_add(3, CheckpointSpec("w3-llama", seed=5))
_add(3, CheckpointSpec("w3-bert-dim1", model="bert", shard_dim=1, seed=6))
_add(3, CheckpointSpec("w3-wrapped-buffer", model="llama-tied", wrappers=True, buffer=True, seed=7))
_add(3, CheckpointSpec("w3-guide-local", model="bert", layout="guide-ranks-local", architecture=True, seed=8))
_add(2, CheckpointSpec("w2-dcp", layout="dcp", seed=14))
_add(3, CheckpointSpec("w3-dcp-nested-bert-dim1", model="bert", layout="dcp-nested", shard_dim=1, seed=15))
_add(
    3, CheckpointSpec("w3-dcp-safetensors", layout="dcp-safetensors", seed=17)
)  # untied: safetensors refuses shared storage
_add(4, CheckpointSpec("w4-dcp-hsdp-tied-bf16", model="llama-tied", dtype="bfloat16", layout="dcp", hsdp=True, seed=16))
_add(4, CheckpointSpec("w4-hsdp-tied", model="llama-tied", hsdp=True, seed=9))
_add(2, CheckpointSpec("w2-dcp-hf", layout="dcp-hf", seed=18))  # HuggingFaceStorageWriter(save_distributed=True)
_add(2, CheckpointSpec("w2-dcp-hf-split-dim1", layout="dcp-hf-split", shard_dim=1, seed=19))
_add(
    4,
    CheckpointSpec(
        "w4-dcp-hf-hsdp-tied-bf16", model="llama-tied", dtype="bfloat16", layout="dcp-hf", hsdp=True, seed=20
    ),
)
_add(4, CheckpointSpec("w4-bf16", dtype="bfloat16", seed=10))
_add(4, CheckpointSpec("w4-hsdp-bert-dim1", model="bert", hsdp=True, shard_dim=1, seed=11))
# Plain tensors in several ranks' files, and files of two steps (tests/trust/test_rank_checks.py).
_add(2, CheckpointSpec("w2-guide-local-buffer", layout="guide-ranks-local", buffer=True, architecture=True, seed=21))
_add(
    3,
    CheckpointSpec(
        "w3-guide-local-bert-dim1", model="bert", layout="guide-ranks-local", shard_dim=1, architecture=True, seed=22
    ),
)
_add(2, CheckpointSpec("w2-ddp", fsdp=False, seed=23))  # DDP: every rank saves the whole model
_add(2, CheckpointSpec("w2-full-state", full_state=True, architecture=True, seed=24))
_add(2, CheckpointSpec("w2-verl-steps", verl_files=True, second_save=True, seed=25))
_add(8, CheckpointSpec("w8-tied", model="llama-tied", seed=12))
_add(8, CheckpointSpec("w8-hsdp-bert", model="bert", hsdp=True, seed=13))

# Options a spec's merge needs: its probe buffer is not part of the model config.json names.
MERGE_OPTIONS = {"w2-guide-local-buffer": {"allow_extra_tensors": True}}

DECODER_AND_MLP = ("LlamaDecoderLayer", "LlamaMLP")
# FSDP1 flat-parameter checkpoints (tests/readers/test_fsdp1_flat.py), name -> (world size, spec). 3 ranks split every flat parameter unevenly; use_orig_params
# adds alignment padding (4 fp32 / 8 bf16 elements) and the padding to the world size.
FSDP1_SPECS = {
    spec.name: (world, spec)
    for world, spec in [
        (2, Fsdp1Spec("w2-llama", seed=21)),
        (2, Fsdp1Spec("w2-tied-orig", model="llama-tied", use_orig_params=True, seed=22)),
        (2, Fsdp1Spec("w2-verl-names", file_name="model_world_size_2_rank_{rank}.pt", seed=23)),
        (2, Fsdp1Spec("w2-root-only", wrap=("none",), seed=31)),
        (3, Fsdp1Spec("w3-orig", use_orig_params=True, seed=24)),
        (3, Fsdp1Spec("w3-tied", model="llama-tied", seed=25)),
        (3, Fsdp1Spec("w3-mlp-units", wrap=DECODER_AND_MLP, seed=26)),
        (3, Fsdp1Spec("w3-bert-orig", model="bert", wrap=("BertLayer",), use_orig_params=True, seed=27)),
        (3, Fsdp1Spec("w3-bf16-orig", dtype="bfloat16", use_orig_params=True, seed=28)),
        (4, Fsdp1Spec("w4-orig", use_orig_params=True, seed=29)),
        (4, Fsdp1Spec("w4-bert", model="bert", wrap=("BertLayer",), seed=30)),
    ]
}

# The reader each spec's layout is read by (fsdpfast.readers.READERS names).
READER_OF_LAYOUT = {
    "fsdp-ranks": "fsdp-ranks",
    "guide-ranks": "guide-ranks",
    "guide-ranks-local": "guide-ranks",
    "dcp": "dcp",
    "dcp-nested": "dcp",
    "dcp-safetensors": "dcp",
    "dcp-hf": "dcp-hf",
    "dcp-hf-split": "dcp-hf",
}


def specs_read_by(reader: str) -> list[str]:
    """The corpus names whose checkpoints `reader` reads, by world size then name."""
    names = [name for name, (_, spec) in SPECS.items() if READER_OF_LAYOUT[spec.layout] == reader]
    return sorted(names, key=lambda name: (SPECS[name][0], name))


def assert_merge_is_the_model(checkpoints, tmp_path, name: str) -> None:
    """The merge of corpus checkpoint `name` (its dtype kept) is the unsharded model bit for bit, its report
    names the tied tensors and the world size, and transformers loads it with the training side's logits."""
    spec, folder = checkpoints.get(name)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    out = tmp_path / "merged"
    report = fsdpfast.merge(folder, out, **MERGE_OPTIONS.get(name, {}))
    assert_bit_exact(read_merged(out), reference, tied=tied)
    assert report.tensors == len(reference) - len(tied)
    assert sorted(n for names in report.tied.values() for n in names) == sorted(tied)
    assert report.world_size == SPECS[name][0]
    logits = transformers_logits(str(out), spec.model, spec.dtype)
    expected = torch.load(spec.logits_path(checkpoints.root), weights_only=True)
    assert torch.equal(logits, expected), (logits - expected).abs().max()
