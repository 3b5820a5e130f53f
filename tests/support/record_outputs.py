"""Record what fsdpfast writes on the test corpus, so a restructuring can show that nothing changed.

    python tests/support/record_outputs.py      # writes tests/data/recorded_outputs/KEY.json (minutes: the corpus)

The corpus is a slice of the suite's own (the same specs and seeds as tests/conftest.py, test_fsdp1_flat,
deepspeed_checkpoints, test_peft_lora, test_save_pretrained; the Megatron fixtures in tests/data), written
by real gloo ranks. Each run (a merge, a `verify --against`, a `save_pretrained`, a LoRA merge, a command
line) writes into a folder of its own; every file it writes is recorded by its sha256, except the JSON
files whose bytes depend on where the run happened (manifests: paths, sizes and mtimes of the sources
and of the files written; adapter configs: their own folder), which are recorded as JSON with those
fields replaced (see `Normaliser`). Reports are recorded the same way, their timings left out.

The inputs are recorded too (`input_digests`: the unsharded model's tensors, the configs beside them):
another torch or transformers build may initialise or train differently, and then the outputs differ
because the corpus does. tests/stages/test_same_outputs.py makes the same runs and compares.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# `--engine auto` must not follow what a benchmark measured on this machine (as in tests/conftest.py)
os.environ["FSDPFAST_MEASUREMENTS"] = os.devnull

import torch  # noqa: E402

import fsdpfast  # noqa: E402
from fsdpfast._testing.deepspeed_examples import DeepSpeedSpec, write_deepspeed_checkpoints  # noqa: E402
from fsdpfast._testing.fsdp1_examples import Fsdp1Spec, write_fsdp1_checkpoints  # noqa: E402
from fsdpfast._testing.fsdp2_writer import CheckpointSpec, build_model, write_checkpoints  # noqa: E402
from fsdpfast._testing.live_examples import LiveSpec, save_live  # noqa: E402
from fsdpfast._testing.peft_examples import PeftSpec, write_peft_checkpoints  # noqa: E402
from fsdpfast.plan.model_check import FROM_CACHE  # noqa: E402

TESTS = Path(__file__).resolve().parent.parent
# One recording per corpus: each machine's CPU trains the corpus's models to other last bits, so the
# outputs of a restructuring are compared with the recording whose inputs are this machine's own.
RECORDINGS = TESTS / "data" / "recorded_outputs"
MEGATRON = TESTS / "data" / "megatron"
MANIFEST = "fsdpfast-manifest.json"
CORPUS_ENV = "FSDPFAST_OUTPUTS_CORPUS"
WORLD = 2  # every spawned corpus is written by two ranks: one process group per kind, each about half a minute

# The suite's specs, by value (tests/conftest.py SPECS and the test files named).
FSDP2 = [
    CheckpointSpec("w2-llama", seed=1),
    CheckpointSpec("w2-tied-bf16", model="llama-tied", dtype="bfloat16", seed=2),
    CheckpointSpec("w2-guide", layout="guide-ranks", seed=3),
    CheckpointSpec("w2-guide-local", layout="guide-ranks-local", architecture=True, second_save=True, seed=4),
    CheckpointSpec("w2-dcp", layout="dcp", seed=14),
    CheckpointSpec("w2-dcp-hf-split-dim1", layout="dcp-hf-split", shard_dim=1, seed=19),
    CheckpointSpec("w2-full-state", full_state=True, architecture=True, seed=24),
]
FSDP1 = [Fsdp1Spec("w2-llama", seed=21), Fsdp1Spec("w2-tied-orig", model="llama-tied", use_orig_params=True, seed=22)]
DEEPSPEED = [
    DeepSpeedSpec("ds-w2-z3-fp32-tied-frozen", 3, tied=True, frozen=True, buffer=True, extra_tag="first", seed=22)
]
LORA = [
    PeftSpec("verl", seed=41),
    PeftSpec("verl-lora-only", lora_only=True, seed=42),
    PeftSpec(
        "two-adapters",
        second=dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj"], use_dora=True),
        meta=False,
        seed=43,
    ),
    PeftSpec(
        "bf16-bias-copies",
        dtype="bfloat16",
        targets=("q_proj", "v_proj", "o_proj"),
        sizes={"attention_bias": True},
        extras={"lora_bias": True, "modules_to_save": ["lm_head"]},
        seed=44,
    ),
]
LIVE = [
    LiveSpec("w2-fp32", seed=31),
    LiveSpec("w2-tied-bf16-to-fp32", model="llama-tied", dtype="bfloat16", save_dtype="fp32", seed=32),
    LiveSpec("w2-dim1-to-bf16", shard_dim=1, save_dtype="bf16", max_shard_size="40KB", seed=34),
]
MEGATRON_FIXTURES = ["tp2_pp1", "tp2_pp2_vpp2_qwen2_tied_bf16"]
PLAIN_MODEL = CheckpointSpec(
    "plain", seed=60
)  # saved in this process, with a tokenizer (test_save_pretrained_refusals)


@dataclass(frozen=True)
class Corpus:
    """Where each kind of checkpoint lies below `root` (written by `write_corpus`)."""

    root: Path

    def fsdp2(self, name: str) -> Path:
        return self.root / "fsdp2" / name

    def fsdp1(self, name: str) -> Path:
        return self.root / "fsdp1" / name

    def deepspeed(self, name: str) -> Path:
        return self.root / "deepspeed" / name

    def lora(self, name: str) -> Path:
        return self.root / "lora" / name

    def live(self, name: str) -> Path:
        return self.root / "live" / name


def write_corpus(root: Path) -> Corpus:
    corpus = Corpus(root)
    _said("writing the corpus")
    write_checkpoints(str(root / "fsdp2"), FSDP2, WORLD)
    write_fsdp1_checkpoints(str(root / "fsdp1"), FSDP1, WORLD)
    if importlib.util.find_spec("deepspeed") is not None:  # the test extra installs it; the test skips its runs
        write_deepspeed_checkpoints(str(root / "deepspeed"), DEEPSPEED, WORLD)
    write_peft_checkpoints(str(root / "lora"), LORA, WORLD)
    _said("saving the live models (the save_pretrained runs)")
    save_live(str(root / "live"), LIVE, WORLD)  # the save_pretrained runs themselves: their folders are outputs
    _said("corpus written")
    return corpus


def written_corpus(default: Path) -> Corpus:
    """The corpus in $FSDPFAST_OUTPUTS_CORPUS when set (written there the first time: reruns while
    restructuring then take seconds), else written afresh into `default`."""
    kept = os.environ.get(CORPUS_ENV)
    if not kept:
        return write_corpus(default)
    done = Path(kept) / "complete"
    if not done.exists():
        write_corpus(Path(kept))
        done.write_text("written by tests/record_outputs.py\n")
    return Corpus(Path(kept))


def _said(what: str) -> None:
    print(f"record_outputs: {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


# --- the inputs' digests -------------------------------------------------------------------------------


def tensors_digest(tensors: dict) -> hashlib._Hash:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name]
        digest.update(f"{name} {value.dtype} {tuple(value.shape)}\n".encode())
        if value.numel():
            digest.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest


def _with_small_files(digest: hashlib._Hash, folder: Path) -> str:
    """The JSON and text files of a checkpoint folder (configs, verl's metadata, DeepSpeed's `latest`) join
    the tensors' digest; the rank files' own bytes do not (a DCP .metadata names its folder), their tensors
    are the reference's."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".json", ".txt", "") and not path.name.startswith("."):
            digest.update(f"{path.relative_to(folder)}\n".encode())
            digest.update(_as_read(path))
    return digest.hexdigest()


def _as_read(path: Path) -> bytes:
    """peft saves target_modules from a set, in the order of this process's string hashes; fsdpfast sorts them."""
    if path.name != "adapter_config.json":
        return path.read_bytes()
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return json.dumps(config, indent=2).encode()


def _reference(path: Path, key: str = "state_dict") -> dict:
    import torch.distributed.tensor  # noqa: F401  (torch.load rebuilds DTensors)

    return torch.load(path, weights_only=True)[key]


def _safetensors_folder(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


def input_digests(corpus: Corpus) -> dict[str, str]:
    """Each input's sha256: the unsharded model (or the weights the writing processes gathered) and the
    small files beside it. Equal digests: the corpus is the recorded one, and so must the outputs be."""
    found = {}
    for spec in FSDP2:
        ref = _reference(Path(spec.reference_path(str(corpus.root / "fsdp2"))))
        found[f"fsdp2/{spec.name}"] = _with_small_files(tensors_digest(ref), corpus.fsdp2(spec.name))
    for spec in FSDP1:
        ref = _reference(Path(spec.reference_path(str(corpus.root / "fsdp1"))))
        found[f"fsdp1/{spec.name}"] = _with_small_files(tensors_digest(ref), corpus.fsdp1(spec.name))
    for spec in [s for s in DEEPSPEED if corpus.deepspeed(s.name).exists()]:
        ref = _reference(Path(spec.reference_path(str(corpus.root / "deepspeed"))))
        found[f"deepspeed/{spec.name}"] = _with_small_files(tensors_digest(ref), corpus.deepspeed(spec.name))
    for spec in LORA:
        ref = _reference(Path(spec.reference_path(str(corpus.root / "lora"))), "full")
        found[f"lora/{spec.name}"] = _with_small_files(tensors_digest(ref), corpus.lora(spec.name))
        if spec.lora_only:  # the --base folder
            base = Path(spec.base_folder(str(corpus.root / "lora")))
            found[f"lora/{spec.name}.base"] = _with_small_files(tensors_digest(_safetensors_folder(base)), base)
    for spec in LIVE:  # the model's own save_pretrained of its gathered state dict, and its config
        reference = corpus.live(spec.name) / "reference"
        found[f"live/{spec.name}"] = _with_small_files(tensors_digest(_safetensors_folder(reference)), reference)
    for name in MEGATRON_FIXTURES:  # committed files: their bytes
        digest = hashlib.sha256()
        for path in sorted((MEGATRON / name).rglob("*")):
            if path.is_file():
                digest.update(f"{path.relative_to(MEGATRON / name)}\n".encode() + path.read_bytes())
        found[f"megatron/{name}"] = digest.hexdigest()
    model = build_model(PLAIN_MODEL)
    with tempfile.TemporaryDirectory() as saved:  # the tokenizer's own files, as this transformers writes them
        tiny_tokenizer().save_pretrained(saved)
        model.config.save_pretrained(saved)
        found["plain-model"] = _with_small_files(tensors_digest(model.state_dict()), Path(saved))
    return found


def tiny_tokenizer():
    """A real fast tokenizer of two words (as tests/live/test_save_pretrained_refusals.py makes it)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocabulary), unk_token="<unk>")


# --- what is recorded of an output -----------------------------------------------------------------------

SAME_AS_THE_FILE = "= the file's"  # a size or mtime in a manifest that is the file's own


class Normaliser:
    """Takes out of outputs and reports what depends on where and when a run happened: the folders'
    absolute paths (named <corpus>, <out>, <data>), timings, whether the model check read its model
    from the cache, and the sizes and mtimes a manifest records of its sources and of the files it
    lists, which are checked against those files instead."""

    def __init__(self, corpus: Path, out: Path):
        places = {"<corpus>": corpus, "<out>": out, "<data>": TESTS / "data"}
        pairs = {}
        for name, folder in places.items():
            pairs[os.path.abspath(folder)] = name
            pairs[os.path.realpath(folder)] = name
        self._places = sorted(pairs.items(), key=lambda pair: -len(pair[0]))  # the longest first: nested folders

    def text(self, value: str) -> str:
        for path, name in self._places:
            value = value.replace(path, name)
        return re.sub(r" in \d+\.\d+ s\b", " in <seconds> s", value)

    def names_a_place(self, data: bytes) -> bool:
        return any(path.encode() in data for path, _ in self._places)

    def value(self, value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items() if k != "seconds"}
        if isinstance(value, (list, tuple)):  # a note that the model came from the cache: an earlier run's doing
            return [self.value(v) for v in value if not (isinstance(v, str) and v.startswith(FROM_CACHE))]
        if isinstance(value, str):
            return self.text(value)
        return value

    def manifest(self, manifest: dict, folder: Path) -> dict:
        manifest = dict(manifest)
        checkpoint = manifest.get("checkpoint")
        if isinstance(manifest.get("sources"), list) and checkpoint:
            manifest["sources"] = [
                self._as_the_file(entry, Path(checkpoint) / entry["path"]) for entry in manifest["sources"]
            ]
        if isinstance(manifest.get("written"), dict):
            manifest["written"] = {
                name: self._as_the_file(entry, folder / name) for name, entry in manifest["written"].items()
            }
        return self.value(manifest)

    @staticmethod
    def _as_the_file(entry: dict, path: Path) -> dict:
        st = path.stat() if path.is_file() else None
        own = {"size": st and st.st_size, "mtime_ns": st and st.st_mtime_ns}
        return {k: SAME_AS_THE_FILE if k in own and v == own[k] else v for k, v in entry.items()}


def file_record(path: Path, folder: Path, normaliser: Normaliser):
    """sha256 of the file's bytes; a manifest, or a JSON file that names a folder of the run, as JSON
    with those parts normalised (and whether it is written as every JSON file fsdpfast writes)."""
    data = path.read_bytes()
    if path.name != MANIFEST and not normaliser.names_a_place(data):
        return "sha256:" + hashlib.sha256(data).hexdigest()
    value = json.loads(data)  # a file that names its path and is not JSON: nothing can normalise it
    record = normaliser.manifest(value, path.parent) if path.name == MANIFEST else normaliser.value(value)
    return {"json": record, "indent-2": data == (json.dumps(value, indent=2) + "\n").encode()}


def folder_record(folder: Path, normaliser: Normaliser) -> dict:
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): file_record(p, folder, normaliser) for p in sorted(folder.rglob("*")) if p.is_file()
    }


# --- the runs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    name: str
    inputs: tuple[str, ...]  # keys of input_digests
    do: Callable[[Path], object]  # writes (or not) into the folder it is given; its report
    output: Callable[[Path], Path] | None = None  # the folder to record, when it is not the one given


@dataclass(frozen=True)
class Merge:
    """`fsdpfast.merge(src, out, **options)`; its options can be read (test_same_outputs makes the
    merges again with the sources read another way)."""

    src: Path
    options: dict

    def __call__(self, out: Path):
        return fsdpfast.merge(self.src, out, **self.options)


def _merge(src: Path, **options) -> Callable[[Path], object]:
    return Merge(src, options)


def _verify(of: str, against: Path) -> Callable[[Path], object]:
    def check(out: Path):
        report = fsdpfast.verify(out.parent / of, against=against)
        return {"ok": report.ok, "report": report, "summary": report.summary()}

    return check


def OUT(out: Path) -> Path:
    return out


def _command(*argv) -> Callable[[Path], object]:
    """`python -m fsdpfast ...` in a process of its own; a callable in argv is given the run's folder."""

    def run(out: Path):
        done = subprocess.run(
            [sys.executable, "-m", "fsdpfast", *(str(a(out) if callable(a) else a) for a in argv)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        stdout = json.loads(done.stdout) if done.stdout.startswith(("{", "[")) else done.stdout
        return {"exit": done.returncode, "stdout": stdout, "stderr": done.stderr}

    return run


def _two_processes(src: Path, *argv) -> Callable[[Path], object]:
    """`fsdpfast merge` as two torchrun processes (tests/support/merge_processes.py) writing one folder."""
    from merge_processes import Ranks

    def run(out: Path):
        ended = Ranks(lambda rank: [src, "--out", out, "--quiet", "--json", *argv], 2).wait()
        return [
            {"exit": code, "stdout": json.loads(stdout) if stdout else "", "stderr": err}
            for code, stdout, err, _ in ended
        ]

    return run


def _save_plain(out: Path):
    return fsdpfast.save_pretrained(build_model(PLAIN_MODEL), out, dtype="bf16", tokenizer=tiny_tokenizer())


def _live_outcome(folder: Path) -> Callable[[Path], object]:
    return lambda out: [json.loads((folder / f"outcome-{rank}.json").read_text()) for rank in range(WORLD)]


def runs(corpus: Corpus) -> list[Run]:
    found = []
    for spec in FSDP2:  # every layout the FSDP2 corpus has, merged as it is
        found.append(Run(f"merge-fsdp2-{spec.name}", (f"fsdp2/{spec.name}",), _merge(corpus.fsdp2(spec.name))))
    llama, tied, dcp = corpus.fsdp2("w2-llama"), corpus.fsdp2("w2-tied-bf16"), corpus.fsdp2("w2-dcp")
    found += [
        Run("merge-fsdp2-w2-llama-bf16", ("fsdp2/w2-llama",), _merge(llama, dtype="bf16")),
        Run("merge-fsdp2-w2-llama-bf16-torch-engine", ("fsdp2/w2-llama",), _merge(llama, dtype="bf16", engine="torch")),
        Run("merge-fsdp2-w2-tied-bf16-to-fp32", ("fsdp2/w2-tied-bf16",), _merge(tied, dtype="fp32")),
        Run("merge-fsdp2-w2-llama-40KB-files", ("fsdp2/w2-llama",), _merge(llama, max_shard_size="40KB")),
        Run("merge-fsdp2-w2-dcp-bf16-40KB-files", ("fsdp2/w2-dcp",), _merge(dcp, dtype="bf16", max_shard_size="40KB")),
        Run("verify-against-fsdp2-w2-llama", ("fsdp2/w2-llama",), _verify("merge-fsdp2-w2-llama", llama)),
        Run(
            "verify-against-fsdp2-w2-dcp-bf16-40KB",
            ("fsdp2/w2-dcp",),
            _verify("merge-fsdp2-w2-dcp-bf16-40KB-files", dcp),
        ),
        Run(
            "verify-manifest-fsdp2-w2-llama-40KB",
            ("fsdp2/w2-llama",),
            lambda out: fsdpfast.verify(out.parent / "merge-fsdp2-w2-llama-40KB-files"),
        ),
        Run(
            "cli-merge-fsdp2-w2-tied-bf16",
            ("fsdp2/w2-tied-bf16",),
            _command("merge", tied, "--out", OUT, "--dtype", "fp32", "--max-shard-size", "40KB", "--quiet", "--json"),
        ),
        Run(
            "cli-dry-run-fsdp2-w2-guide-local-bf16-40KB",
            ("fsdp2/w2-guide-local",),
            _command(
                "merge",
                corpus.fsdp2("w2-guide-local"),
                "--out",
                OUT,
                "--dtype",
                "bf16",
                "--max-shard-size",
                "40KB",
                "--dry-run",
                "--json",
            ),
        ),
        Run(
            "cli-verify-against-fsdp2-w2-tied-bf16",
            ("fsdp2/w2-tied-bf16",),
            _command("verify", lambda out: out.parent / "cli-merge-fsdp2-w2-tied-bf16", "--against", tied, "--json"),
        ),
        Run("merge-processes-fsdp2-w2-llama-bf16", ("fsdp2/w2-llama",), _two_processes(llama, "--dtype", "bf16")),
    ]
    for spec in FSDP1:
        folder = corpus.fsdp1(spec.name)
        found.append(
            Run(f"merge-fsdp1-{spec.name}", (f"fsdp1/{spec.name}",), _merge(folder, wrap=list(spec.wrap) or None))
        )
    found.append(
        Run(
            "verify-against-fsdp1-w2-tied-orig",
            ("fsdp1/w2-tied-orig",),
            _verify("merge-fsdp1-w2-tied-orig", corpus.fsdp1("w2-tied-orig")),
        )
    )
    for spec in DEEPSPEED:
        folder = corpus.deepspeed(spec.name)
        found.append(Run(f"merge-deepspeed-{spec.name}", (f"deepspeed/{spec.name}",), _merge(folder)))
        found.append(
            Run(
                f"verify-against-deepspeed-{spec.name}",
                (f"deepspeed/{spec.name}",),
                _verify(f"merge-deepspeed-{spec.name}", folder),
            )
        )
    for name in MEGATRON_FIXTURES:
        run = MEGATRON / name / "run"
        found.append(Run(f"merge-megatron-{name}", (f"megatron/{name}",), _merge(run, config=MEGATRON / name / "hf")))
        found.append(
            Run(f"verify-against-megatron-{name}", (f"megatron/{name}",), _verify(f"merge-megatron-{name}", run))
        )
    found += _lora_runs(corpus)
    for spec in LIVE:  # written by the corpus's ranks; recorded here
        folder = corpus.live(spec.name)
        found.append(
            Run(
                f"save-pretrained-{spec.name}",
                (f"live/{spec.name}",),
                _live_outcome(folder),
                lambda out, f=folder: f / "live",
            )
        )
    found.append(Run("save-pretrained-plain-bf16-tokenizer", ("plain-model",), _save_plain))
    return found


def _lora_runs(corpus: Corpus) -> list[Run]:
    verl, only, two = corpus.lora("verl"), corpus.lora("verl-lora-only"), corpus.lora("two-adapters")
    base = Path(LORA[1].base_folder(str(corpus.root / "lora")))
    return [
        Run("lora-verl-adapter-folder", ("lora/verl",), _merge(verl)),
        Run("lora-verl-fused", ("lora/verl",), _merge(verl, merge_lora=True)),
        Run("lora-verl-fused-bf16", ("lora/verl",), _merge(verl, merge_lora=True, dtype="bf16")),
        Run("lora-two-adapters-folders", ("lora/two-adapters",), _merge(two)),
        Run("lora-two-adapters-fused-default", ("lora/two-adapters",), _merge(two, merge_lora="default")),
        Run(
            "lora-bf16-bias-copies-adapter-folder", ("lora/bf16-bias-copies",), _merge(corpus.lora("bf16-bias-copies"))
        ),
        Run("lora-only-adapter-alone", ("lora/verl-lora-only",), _merge(only)),
        Run("lora-only-with-base", ("lora/verl-lora-only", "lora/verl-lora-only.base"), _merge(only, base=base)),
        Run("verify-against-lora-verl-adapter-folder", ("lora/verl",), _verify("lora-verl-adapter-folder", verl)),
        Run("verify-against-lora-verl-fused", ("lora/verl",), _verify("lora-verl-fused", verl)),
        Run(
            "verify-against-lora-two-adapters-folders",
            ("lora/two-adapters",),
            _verify("lora-two-adapters-folders", two),
        ),
        Run("verify-against-lora-only-with-base", ("lora/verl-lora-only",), _verify("lora-only-with-base", only)),
        Run(
            "cli-merge-lora-verl-fused",
            ("lora/verl",),
            _command("merge", verl, "--out", OUT, "--merge-lora", "--quiet", "--json"),
        ),
    ]


def record_runs(corpus: Corpus, out_root: Path, inputs: dict[str, str]) -> dict[str, dict]:
    """Each run whose inputs were written, made in turn, in folders below `out_root`: {run: {inputs, files,
    report}}. A run that raises is recorded with its error (the type and message), so the others still compare."""
    normaliser = Normaliser(corpus.root, out_root)
    _said("the runs")
    found = {}
    for run in runs(corpus):
        if not set(run.inputs) <= set(inputs):
            continue
        out = out_root / run.name
        try:
            report = normaliser.value(run.do(out))
        except Exception as exc:  # recorded: a run that fails where the recording did not is a difference
            report = {"raised": normaliser.text(f"{type(exc).__name__}: {exc}")}
            traceback.print_exc()
        written = run.output(out) if run.output else out
        found[run.name] = {"inputs": list(run.inputs), "files": folder_record(written, normaliser), "report": report}
    return found


def versions() -> dict[str, str]:
    import importlib.metadata

    found = {"python": sys.version.split()[0]}
    for package in ("torch", "transformers", "peft", "safetensors", "tokenizers", "deepspeed"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def record(root: Path) -> dict:
    corpus = written_corpus(root / "corpus")
    inputs = input_digests(corpus)
    return {"recorded_with": versions(), "inputs": inputs, "runs": record_runs(corpus, root / "out", inputs)}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fsdpfast-record-") as root:
        recorded = record(Path(root))
    left_out = [run.name for run in runs(Corpus(Path(root))) if run.name not in recorded["runs"]]
    if left_out:  # a recording is complete: install the test extra (deepspeed)
        sys.exit(f"these runs' inputs were not written, nothing recorded: {', '.join(left_out)}")
    raised = [name for name, run in recorded["runs"].items() if "raised" in (run["report"] or {})]
    if raised:  # what is recorded must be what the code does when it works
        sys.exit(f"these runs raised, nothing recorded: {', '.join(raised)}")
    path = RECORDINGS / f"{recording_key(recorded['inputs'])}.json"
    path.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"{path}: {len(recorded['runs'])} runs, {sum(len(r['files']) for r in recorded['runs'].values())} files")


def recording_key(inputs: dict) -> str:
    """A recording's file name: its corpus's digests, so each corpus has one."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]


def recordings() -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(RECORDINGS.glob("*.json"))]


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS / "support"))  # merge_processes, as pytest's pythonpath has it
    main()
