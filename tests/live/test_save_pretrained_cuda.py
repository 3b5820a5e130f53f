"""`fsdpfast.save_pretrained` from live FSDP2 models whose tensors are on a GPU (skipped without one).

One rank on NCCL with the model on cuda:0 (trained one step; the reference is
`get_model_state_dict(full_state_dict=True)`), and two ranks on gloo with CUDA tensors on the same
GPU (NCCL refuses two ranks on one GPU; gloo has no CUDA collectives for FSDP2's training, so the
reference is the unsharded model saved before sharding). Each folder must hold the reference's
tensors bit for bit, cast where asked: on the GPU by the extension's CUDA op, or by torch's `.to()`
(torch_cast), then written from pinned host buffers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import live_outcomes, read_merged

import fsdpfast
from fsdpfast._testing.live_examples import LiveSpec, save_live

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible"),
    pytest.mark.distributed,
    pytest.mark.gpu,
    pytest.mark.torch_ops,
]

RUNS = {  # (world size, backend): specs
    (1, "nccl"): [
        LiveSpec("c1-nccl-fp32", device="cuda", seed=51),
        LiveSpec("c1-nccl-fp32-to-bf16", device="cuda", save_dtype="bf16", max_shard_size="40KB", seed=52),
        LiveSpec("c1-nccl-fp32-to-bf16-torch-cast", device="cuda", save_dtype="bf16", torch_cast=True, seed=53),
        LiveSpec("c1-nccl-bf16", device="cuda", dtype="bfloat16", seed=54),
        LiveSpec("c1-nccl-bf16-to-fp32", device="cuda", dtype="bfloat16", save_dtype="fp32", seed=55),
    ],
    (2, "gloo"): [
        LiveSpec("c2-gloo-fp32", device="cuda", seed=56),
        LiveSpec("c2-gloo-fp32-to-bf16", device="cuda", save_dtype="bf16", max_shard_size="40KB", seed=57),
    ],
}
ALL = {spec.name: (world, spec) for (world, _), specs in RUNS.items() for spec in specs}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("live-cuda")
    for (world, backend), specs in RUNS.items():
        if backend == "nccl" and not dist.is_nccl_available():
            continue
        save_live(str(root), specs, world, backend=backend)
    return root


@pytest.mark.parametrize("name", list(ALL))
def test_the_folder_is_the_reference_bit_for_bit(saved, name):
    world, spec = ALL[name]
    folder = saved / name
    if not folder.exists():
        pytest.skip("NCCL is not available")
    results = live_outcomes(folder, world)
    assert all(o["ok"] for o in results), results
    live, reference = read_merged(folder / "live"), read_merged(folder / "reference")
    assert set(live) == set(reference)
    cast = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[spec.save_dtype]
    for key, want in reference.items():
        want = want.to(cast) if cast is not None and want.is_floating_point() else want
        assert live[key].dtype == want.dtype, key
        assert torch.equal(live[key].view(torch.uint8), want.view(torch.uint8)), key
    if spec.max_shard_size != "5GB":
        assert len(list((folder / "live").glob("*.safetensors"))) > 1  # the split is tested too
    assert fsdpfast.verify(folder / "live").ok
