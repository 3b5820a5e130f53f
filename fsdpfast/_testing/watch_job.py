"""A training run that saves several steps, as the frameworks do, for the tests of `fsdpfast watch`.

Real gloo ranks, FSDP2 (`fully_shard`) on a tiny Llama, one AdamW step between saves. Each save
writes the step's checkpoint into the run folder and then the framework's mark that it is
complete (watch.discover), `pause` seconds after its files, so a watcher looks at a step still
being written:
- "verl": `global_step_N/actor/` rank files (verl's names) and `actor/huggingface/`, then the run
  folder's latest_checkpointed_iteration.txt naming N (rank 0, after a barrier);
- "torchtitan": `step-N/` saved by torch.distributed.checkpoint (its `.metadata` last), the
  config in `step-N/huggingface/`. With `store` (a URL: the run folder in an object store) the
  steps go there, through torch's own FsspecWriter on obstore's fsspec filesystem (s3fs is not
  installed: it pins an older botocore than the tests' boto3; each write copied: _copying_store),
  `huggingface/` uploaded first.
Rank 0 saves each step's unsharded model to `refs/<checkpoint name>.pt` before the mark, for a
bit-for-bit comparison.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from .fsdp2_writer import CheckpointSpec, _save_rank, _train_one_step, _write_hf_files, build_model, spawn_writers


@dataclass(frozen=True)
class RunSpec:
    framework: str  # verl | torchtitan
    steps: int = 3
    pause: float = 0.0  # seconds between a step's files and its mark of completion
    sizes: dict = field(default_factory=dict)  # the Llama's config overrides (a larger one: a longer merge)
    seed: int = 40
    store: str | None = None  # torchtitan: the run folder's URL in an object store, instead of root/run

    def checkpoint(self, step: int) -> str:
        return f"global_step_{step}" if self.framework == "verl" else f"step-{step}"


def write_run(root: str, spec: RunSpec, world_size: int) -> None:
    """Run the job: `root/run/` gets the checkpoints, `root/refs/` the unsharded models."""
    spawn_writers(root, [spec], world_size, _run_steps)


def _run_steps(rank: int, world_size: int, root: str, spec: RunSpec) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    run, refs = os.path.join(root, "run"), os.path.join(root, "refs")
    os.makedirs(run, exist_ok=True)
    os.makedirs(refs, exist_ok=True)
    layout = "fsdp-ranks" if spec.framework == "verl" else "dcp"
    model_spec = CheckpointSpec("watched", layout=layout, architecture=True, sizes=spec.sizes, seed=spec.seed)
    model = build_model(model_spec)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for step in range(1, spec.steps + 1):
        _train_one_step(model, model_spec)
        name = spec.checkpoint(step)
        folder = os.path.join(run, name, "actor") if spec.framework == "verl" else os.path.join(run, name)
        if spec.store:
            folder = f"{spec.store.rstrip('/')}/{name}"
        full = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        }
        if rank == 0:
            if spec.store:
                _upload_hf_files(os.path.join(root, "hf", name), f"{folder}/huggingface", model_spec)
            else:
                _write_hf_files(os.path.join(folder, "huggingface"), model_spec)
            torch.save({"state_dict": full, "tied": []}, os.path.join(refs, f"{name}.pt"))
        dist.barrier()
        if spec.store:
            _save_to_store(folder, model.state_dict())
        else:
            _save_rank(folder, rank, world_size, model_spec, model.state_dict(), model)
        dist.barrier()
        if spec.pause:
            time.sleep(spec.pause)
        if rank == 0 and spec.framework == "verl":  # verl's trainer, once every rank saved
            with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(step))
        dist.barrier()


def _store_options() -> dict:
    """obstore's fsspec filesystem options: the endpoint the AWS tools read (a local S3-compatible
    server over http in the tests)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    return {
        "config": {"endpoint": endpoint} if endpoint else None,
        "client_options": {"allow_http": endpoint.startswith("http:")},
    }


def _save_to_store(url: str, state: dict) -> None:
    """torch.distributed.checkpoint's collective save straight into the store: FsspecWriter writes
    each rank's `.distcp` object, then `.metadata.tmp`, renamed (a server-side copy) to `.metadata`."""
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    fsspec.register_implementation("s3", _copying_store(), clobber=True)  # fsspec's s3:// through obstore
    dcp.save(state, storage_writer=FsspecWriter(url, sync_files=False, **_store_options()))


def _copying_store():
    """obstore's fsspec filesystem, each write handed a copy: obstore 0.12's writable file keeps a
    reference to the caller's buffer until its part is uploaded, and torch.save reuses its buffers,
    so the object would hold whatever the buffer held last (fsdpfast refuses such a .distcp)."""
    import obstore.fsspec

    class CopyingFile(obstore.fsspec.BufferedFile):
        def write(self, data) -> int:
            return super().write(bytes(data))

    class CopyingStore(obstore.fsspec.FsspecStore):
        protocol = "s3"

        def _open(self, path, mode="rb", **kwargs):
            return CopyingFile(self, path, mode, **kwargs) if mode == "wb" else super()._open(path, mode, **kwargs)

    return CopyingStore


def _upload_hf_files(local: str, url: str, spec) -> None:
    os.makedirs(local, exist_ok=True)
    _write_hf_files(local, spec)
    fs = _copying_store()(**_store_options())
    for name in sorted(os.listdir(local)):
        fs.put_file(os.path.join(local, name), f"{url}/{name}")
