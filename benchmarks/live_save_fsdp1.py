"""Saving a live FSDP1 model (FullyShardedDataParallel) as a Hugging Face folder, on gloo ranks (CPU).

  fsdpfast      fsdpfast.save_pretrained(model, out): every rank writes its runs of the flat shard
                in place (no collective)
  sharded-sd    FSDP1's SHARDED_STATE_DICT alone (what a writer re-using FSDP1's own row split would
                start from): all-gathers each unit's flat parameter and re-chunks every parameter;
                nothing is written
  gather        FULL_STATE_DICT (rank0_only; the model is on the CPU already), then rank 0's save_pretrained: what
                accelerate and the Trainer do with FSDP1

Each way runs in fresh processes on the same seeded model, for --rounds rounds; the table gives
each way's median seconds (from a barrier to a barrier) and rank 0's peak RSS growth during it
(the peak reset through /proc/self/clear_refs just before).

    python benchmarks/live_save_fsdp1.py --world 2 --hidden 512 --layers 8 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.live_save import _rss_mb, finish_rank, llama_config, spawn_way, table_lines  # noqa: E402


def _reset_peak() -> None:
    """Start rank 0's peak RSS afresh (building the model peaks higher than the save)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


WAYS = ("fsdpfast", "sharded-sd", "gather")


def _rank(rank: int, world: int, port: int, way: str, args, result_path: str) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = llama_config(args)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({transformers.models.llama.modeling_llama.LlamaDecoderLayer}),
        use_orig_params=args.use_orig_params,
        device_id=torch.device("cpu"),
        param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False),
    )
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    for module in ("torch.distributed.tensor", "fsdpfast.live.save"):  # imports are no way's cost (once per process)
        importlib.import_module(module)

    out = os.path.join(args.workdir, f"{way}-out")
    dist.barrier()
    _reset_peak()
    before = _rss_mb()
    start = time.perf_counter()
    if way == "fsdpfast":
        import fsdpfast

        fsdpfast.save_pretrained(model, out, dtype="bf16")
    elif way == "sharded-sd":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = model.state_dict()
        del state
    else:
        full_config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)  # CPU already (offload would free it)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_config):
            full = model.state_dict()
        if rank == 0:
            model.module.save_pretrained(out, state_dict={k: v.to(torch.bfloat16) for k, v in full.items()})
        del full
    finish_rank(rank, result_path, start, before, _peak_mb)


def run_way(way: str, args) -> dict:
    return spawn_way(_rank, way, args, leftovers=(f"{way}-out",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--use-orig-params", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="fsdpfast-live-fsdp1-")
    results = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            results[way].append(run_way(way, args))
    size = sum(
        os.path.getsize(os.path.join(args.workdir, "fsdpfast-out", f))
        for f in os.listdir(os.path.join(args.workdir, "fsdpfast-out"))
        if f.endswith(".safetensors")
    )
    print(
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {size / 1e9:.2f} GB in bf16; "
        f"FSDP1 use_orig_params={args.use_orig_params}; {args.world} gloo ranks; {args.rounds} rounds, medians"
    )
    print("\n".join(table_lines(results)))
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
