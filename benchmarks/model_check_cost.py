"""What the model-shape safety net costs a merge: import, build on the meta device, compare names.

    python benchmarks/model_check_cost.py [--repeat 3]

Llama-3-shaped configs of 8B, 70B and 405B (32, 80 and 126 layers) are written to a temporary
folder; each row is a fresh process that imports torch and transformers, builds the class on the
meta device and checks the model's own names and shapes against it (the check a merge runs
before writing). Prints a markdown table of medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SHAPES = {  # hidden, ffn, layers, heads, kv heads, vocab
    "8B": (4096, 14336, 32, 32, 8, 128256),
    "70B": (8192, 28672, 80, 64, 8, 128256),
    "405B": (16384, 53248, 126, 128, 8, 128256),
}

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
t1 = time.perf_counter()
from fsdpfast.plan.model_check import check_against_model, load_expected_model
expected, why = load_expected_model(sys.argv[1])
assert expected is not None, why
t2 = time.perf_counter()
check_against_model(dict(expected.shapes), expected, allow_extra=False)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "build": t2 - t1, "check": t3 - t2, "tensors": len(expected.shapes)}))
"""


def write_config(folder: str, size: str) -> None:
    hidden, ffn, layers, heads, kv, vocab = SHAPES[size]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": ffn,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "vocab_size": vocab,
                "tie_word_embeddings": False,
            },
            f,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| model | tensors | import torch + transformers, s | build on meta, s | compare names and shapes, s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for size in SHAPES:
            folder = os.path.join(root, size)
            write_config(folder, size)
            runs = [  # each with a cache folder of its own: built, never read back (plan.model_cache)
                json.loads(
                    subprocess.run(
                        [sys.executable, "-c", _CHILD, folder],
                        check=True,
                        capture_output=True,
                        text=True,
                        env={**os.environ, "FSDPFAST_CACHE_DIR": os.path.join(root, f"cache-{size}-{i}")},
                    ).stdout
                )
                for i in range(args.repeat)
            ]
            cells = []
            for key in ("import", "build", "check"):
                values = [r[key] for r in runs]
                cells.append(f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
            print(f"| {size} | {runs[0]['tensors']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
