"""`fsdpfast demo`: write a small real FSDP2 checkpoint with gloo, merge it, check it bit for bit."""

from __future__ import annotations

import os
import shutil
import tempfile

from .errors import BadInput


def run_demo(workdir: str | None = None, world_size: int = 4) -> int:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise BadInput("the demo needs transformers: pip install 'fsdpfast[demo]'") from None
    from ._testing.fsdp2_writer import PROBE_INPUT, CheckpointSpec, write_checkpoints
    from .api import merge

    root = workdir or tempfile.mkdtemp(prefix="fsdpfast-demo-")
    try:
        spec = CheckpointSpec(
            "llama-fsdp2", model="llama-tied", sizes=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4)
        )
        print(f"writing a {world_size}-rank FSDP2 checkpoint of a tiny Llama with gloo in {root} ...")
        write_checkpoints(root, [spec], world_size)
        saved = torch.load(spec.reference_path(root), weights_only=True)
        reference, tied = saved["state_dict"], set(saved["tied"])

        for dtype, torch_dtype in (("keep", None), ("bf16", torch.bfloat16)):
            out = os.path.join(root, f"merged-{dtype}")
            shutil.rmtree(out, ignore_errors=True)
            report = merge(spec.folder(root), out, dtype=dtype)
            print(report.summary())
            mismatched = _compare(out, reference, tied, torch_dtype)
            if mismatched:
                print(f"FAILED: {len(mismatched)} tensors differ from the unsharded model: {mismatched[:5]}")
                return 1
            print(
                f"ok: all {report.tensors} tensors equal the unsharded model bit for bit"
                + (f" after .to({dtype})" if torch_dtype else "")
            )

        model = transformers.LlamaForCausalLM.from_pretrained(os.path.join(root, "merged-keep"))
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROBE_INPUT)).logits
        if not torch.equal(logits, torch.load(spec.logits_path(root), weights_only=True)):
            print("FAILED: transformers' logits differ from the sharded model's")
            return 1
        print("ok: transformers loads the merged folder and its logits equal the sharded model's exactly")
        return 0
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _compare(out: str, reference: dict, tied: set, torch_dtype) -> list[str]:
    import torch
    from safetensors.torch import load_file

    merged = load_file(os.path.join(out, "model.safetensors"))
    expected = {k: v for k, v in reference.items() if k not in tied}
    if set(merged) != set(expected):
        return sorted(set(merged) ^ set(expected))
    bad = []
    for name, want in expected.items():
        if torch_dtype is not None and want.is_floating_point():
            want = want.to(torch_dtype)
        got = merged[name]
        if got.dtype != want.dtype or not got.reshape(-1).view(torch.uint8).equal(want.reshape(-1).view(torch.uint8)):
            bad.append(name)
    return bad
