"""Today's MoE families merged to the layout `save_pretrained` of the same model writes (families.transform).

Checkpoints: tiny transformers 5 models (fsdpfast._testing.family_writer) sharded by FSDP2 on gloo
ranks, saved as verl's rank files and as DCP; the anchor is the unsharded model's own
save_pretrained. Every merge must equal it bit for bit (names, dtypes, bytes) and load with
from_pretrained with no missing or unexpected key.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import read_merged
from refusals import api_refuses

import fsdpfast
from fsdpfast._testing.family_writer import (
    DEEPSEEK_V3,
    ENCODER,
    GEMMA3,
    LLAMA4,
    LLAVA,
    MISTRAL3,
    QWEN2_5_VL,
    QWEN3_5_MOE,
    QWEN3_5_MOE_TEXT,
    QWEN3_VL,
    TEXT,
    FamilySpec,
    build_family_model,
    write_family_checkpoints,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SPECS = {
    2: [
        FamilySpec(
            "qwen3_moe", "qwen3_moe", dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2), seed=1
        ),
        FamilySpec("mixtral", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2), seed=2),
        # multi-latent attention computes with as many key/value heads as query heads
        FamilySpec("deepseek_v3", "deepseek_v3", {**DEEPSEEK_V3, "num_key_value_heads": 4}, seed=3),
        FamilySpec("gpt_oss", "gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2), seed=4),  # keeps its names
        # vision-language models: the Hub's prefixes (visual., language_model.model., ...)
        FamilySpec("qwen2_5_vl", "qwen2_5_vl", QWEN2_5_VL, seed=6, auto_class="AutoModelForImageTextToText"),
        FamilySpec("gemma3", "gemma3", GEMMA3, seed=7, auto_class="AutoModelForImageTextToText"),
        FamilySpec("mistral3", "mistral3", MISTRAL3, seed=20, auto_class="AutoModelForImageTextToText"),
        FamilySpec("llava", "llava", LLAVA, seed=21, auto_class="AutoModelForImageTextToText"),
        # Qwen3.5-MoE: transformers 5.25 saves its experts per expert (its text model's rule), the VLM and text-only
        FamilySpec("qwen3_5_moe", "qwen3_5_moe", QWEN3_5_MOE, seed=9, auto_class="AutoModelForImageTextToText"),
        FamilySpec("qwen3_5_moe_text", "qwen3_5_moe_text", QWEN3_5_MOE_TEXT, seed=10),
        # keep their names: Llama 4 (packed experts, transposed in memory as on the Hub), Qwen3-VL, dense models
        FamilySpec("llama4", "llama4", LLAMA4, seed=11, auto_class="AutoModelForImageTextToText"),
        FamilySpec("qwen3_vl", "qwen3_vl", QWEN3_VL, seed=12, auto_class="AutoModelForImageTextToText"),
        FamilySpec("qwen3", "qwen3", seed=13),
        FamilySpec("gemma3_text", "gemma3_text", seed=14),
        FamilySpec("phi3", "phi3", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2), seed=15),
        # a reward model (score head on the last token) and a verl critic (a value per token)
        FamilySpec(
            "reward",
            "qwen3",
            dict(TEXT, num_labels=1, pad_token_id=0),
            seed=16,
            auto_class="AutoModelForSequenceClassification",
        ),
        FamilySpec("critic", "qwen3", dict(TEXT, num_labels=1), seed=17, auto_class="AutoModelForTokenClassification"),
        FamilySpec("bert", "bert", ENCODER, seed=18, auto_class="AutoModelForMaskedLM"),
        FamilySpec(
            "modernbert",
            "modernbert",
            dict(
                ENCODER,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                cls_token_id=3,
                sep_token_id=4,
                local_attention=16,
            ),
            seed=19,
            auto_class="AutoModelForMaskedLM",
        ),
    ],
    # 5 experts over 3 ranks: FSDP2's Shard(0) cuts the packed tensors between experts unevenly
    3: [FamilySpec("glm4_moe-w3-bf16", "glm4_moe", {**DEEPSEEK_V3, "n_routed_experts": 5}, dtype="bfloat16", seed=5)],
}
FAMILIES = [(world, spec) for world, specs in SPECS.items() for spec in specs]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for world, specs in SPECS.items():
        write_family_checkpoints(str(root), specs, world)
    return root


def assert_same_files(merged: dict, anchor: dict) -> None:
    assert sorted(merged) == sorted(anchor), sorted(set(merged) ^ set(anchor))
    for name, want in anchor.items():
        got = merged[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("layout", ["ranks", "dcp"])
@pytest.mark.parametrize("world,spec", FAMILIES, ids=[spec.name for _, spec in FAMILIES])
def test_merged_as_save_pretrained_writes_it(families, tmp_path, world, spec, layout):
    src = spec.ranks_folder(str(families)) if layout == "ranks" else spec.dcp_folder(str(families))
    out = tmp_path / "out"
    report = fsdpfast.merge(src, out)
    assert_same_files(read_merged(out), read_merged(spec.anchor_folder(str(families))))
    assert report.world_size == world
    if layout == "ranks":  # the folder is the model: from_pretrained finds every weight and nothing else
        import transformers

        model, info = getattr(transformers, spec.auto_class).from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert not any(k for k in ("mismatched_keys", "error_msgs") if info.get(k)), info
        assert_same_logits(model, build_family_model(spec))


def assert_same_logits(loaded, trained) -> None:
    """The loaded folder computes what the training model computes (text tokens: every family takes them).
    The loaded weights are copied first: from_pretrained maps them from the file, and a matrix product
    over memory aligned otherwise may round its last bit otherwise (the reward model's one-row score head)."""
    for parameter in loaded.parameters():
        parameter.data = parameter.data.clone()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded.eval()(input_ids=ids).logits, trained.eval()(input_ids=ids).logits
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("world,spec", FAMILIES, ids=[spec.name for _, spec in FAMILIES])
def test_live_save_pretrained_writes_the_hub_layout(families, world, spec):
    # fsdpfast.save_pretrained of the FSDP2-sharded model (family_writer): the files save_pretrained of the
    # unsharded model writes, bit for bit
    assert_same_files(read_merged(spec.live_folder(str(families))), read_merged(spec.anchor_folder(str(families))))


def test_packed_keeps_the_names_transformers_holds(families, tmp_path):
    spec = SPECS[2][0]
    out = tmp_path / "packed"
    fsdpfast.merge(spec.ranks_folder(str(families)), out, expert_layout="packed")
    merged = read_merged(out)
    state = build_family_model(spec).state_dict()
    assert sorted(merged) == sorted(state)
    for name, value in state.items():
        assert torch.equal(merged[name], value), name
    assert fsdpfast.verify(out, against=spec.ranks_folder(str(families))).ok


def test_verify_against_the_checkpoint_replans_the_hub_layout(families, tmp_path):
    spec = SPECS[2][1]  # mixtral: split and renamed
    out = tmp_path / "out"
    fsdpfast.merge(spec.dcp_folder(str(families)), out, dtype="bf16")
    report = fsdpfast.verify(out, against=spec.dcp_folder(str(families)))
    assert report.ok and report.tensors == len(read_merged(out)), report.summary()


# (checkpoint, config of another family, what the refusal names): Gemma 3's config ties its head to
# the embeddings, which Qwen2.5-VL's two distinct tensors are not
OTHER_FAMILY = [
    ("qwen3_moe", "mixtral", "MixtralForCausalLM"),
    ("qwen2_5_vl", "gemma3", "tie_word_embeddings"),
]


@pytest.mark.parametrize("checkpoint,config,named", OTHER_FAMILY, ids=[f"{a}-with-{b}" for a, b, _ in OTHER_FAMILY])
def test_a_config_of_another_family_is_refused(families, tmp_path, checkpoint, config, named):
    # its renames and splits would apply to names they do not fit: the model check refuses
    spec = {s.name: s for _, s in FAMILIES}
    src = tmp_path / "ckpt"
    shutil.copytree(spec[checkpoint].ranks_folder(str(families)), src)
    shutil.copy(
        f"{spec[config].ranks_folder(str(families))}/huggingface/config.json", src / "huggingface" / "config.json"
    )
    api_refuses(src, tmp_path / "out", mentions=[named])


def test_expert_counts_that_disagree_with_config_are_refused(families, tmp_path):
    spec = SPECS[2][0]
    src = tmp_path / "ckpt"
    shutil.copytree(spec.ranks_folder(str(families)), src)
    path = src / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config["num_local_experts"] = 8  # the checkpoint packs 4 (transformers 5 saves num_experts under this name)
    path.write_text(json.dumps(config))
    api_refuses(src, tmp_path / "out", mentions=["experts"])


def test_an_unknown_expert_layout_is_refused(families, tmp_path):
    api_refuses(
        SPECS[2][0].ranks_folder(str(families)), tmp_path / "out", mentions=["expert_layout"], expert_layout="x"
    )


CASTS = [("deepseek_v3", "bf16"), ("deepseek_v3", "fp16"), ("glm4_moe-w3-bf16", "bf16"), ("gpt_oss", "fp16")]


@pytest.mark.parametrize("name,dtype", CASTS, ids=[f"{n}-{d}" for n, d in CASTS])
def test_a_cast_keeps_in_float32_what_transformers_keeps(families, tmp_path, name, dtype):
    # DeepSeek-V3 and GLM-4.5 keep the router and its bias in float32 for bf16 and fp16
    # (_keep_in_fp32_modules_strict), gpt-oss its norms for fp16 (_keep_in_fp32_modules).
    import transformers

    spec = next(spec for _, spec in FAMILIES if spec.name == name)
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(spec.anchor_folder(str(families)), dtype=wanted)
    model.save_pretrained(tmp_path / "anchor")
    report = fsdpfast.merge(spec.ranks_folder(str(families)), tmp_path / "out", dtype=dtype)
    merged = read_merged(tmp_path / "out")
    assert_same_files(merged, read_merged(tmp_path / "anchor"))
    assert any(merged[k].dtype == torch.float32 for k in merged), "nothing kept in float32"
    assert any("kept in float32" in note for note in report.notes), report.notes
    assert fsdpfast.verify(tmp_path / "out", against=spec.ranks_folder(str(families))).ok  # recomputed as cast


def qwen3_vl_moe(name: str, experts: int, dtype: str = "float32") -> FamilySpec:
    # moe_intermediate_size 8: 2I = 16 and I = 8 differ from H = 32, so the shapes tell the orientation
    text = dict(TEXT, moe_intermediate_size=8, num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32)
    return FamilySpec(
        name,
        "qwen3_vl_moe",
        dict(text_config=text, vision_config=vision),
        dtype=dtype,
        seed=8,
        auto_class="AutoModelForImageTextToText",
    )


# Qwen3-VL-MoE: 4 experts on 2 ranks; 5 on 3 ranks in bfloat16 (FSDP2 cuts the packed tensors 2, 2, 1)
TRANSPOSED = {2: [qwen3_vl_moe("qwen3_vl_moe", 4)], 3: [qwen3_vl_moe("qwen3_vl_moe-w3-bf16", 5, "bfloat16")]}


@pytest.fixture(scope="module")
def transposed_families(tmp_path_factory):
    root = tmp_path_factory.mktemp("transposed")
    for world, specs in TRANSPOSED.items():
        write_family_checkpoints(str(root), specs, world)
    return root


def hub_transposed(anchor: dict) -> dict:
    """save_pretrained's files with the packed experts transposed, as Qwen3-VL-MoE's Hub checkpoints hold them
    (transformers 5.25's save_pretrained keeps transformers' own [E, 2I, H]: execute.transposed's docstring)."""
    return {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in anchor.items()}


@pytest.mark.parametrize("layout", ["ranks", "dcp"])
@pytest.mark.parametrize("engine", ["cpu", "torch"])
@pytest.mark.parametrize(
    "world,spec", [(w, s) for w, specs in TRANSPOSED.items() for s in specs], ids=lambda x: getattr(x, "name", str(x))
)
def test_transposed_hub_experts(transposed_families, tmp_path, world, spec, layout, engine):
    import transformers

    root = str(transposed_families)
    src = spec.ranks_folder(root) if layout == "ranks" else spec.dcp_folder(root)
    report = fsdpfast.merge(src, tmp_path / "out", engine=engine)
    anchor = read_merged(spec.anchor_folder(root))
    merged = read_merged(tmp_path / "out")
    assert any(".mlp.experts.gate_up_proj" in k for k in merged)
    assert_same_files(merged, hub_transposed(anchor))
    assert any("written transposed" in note for note in report.notes), report.notes
    assert fsdpfast.verify(tmp_path / "out", against=src).ok
    if layout == "ranks" and engine == "cpu":  # transformers loads it (transposing back) and computes the same
        model, info = transformers.AutoModelForImageTextToText.from_pretrained(
            tmp_path / "out", output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        assert_same_logits(model, build_family_model(spec))


@pytest.mark.parametrize(
    "world,spec", [(w, s) for w, specs in TRANSPOSED.items() for s in specs], ids=lambda x: getattr(x, "name", str(x))
)
def test_live_save_pretrained_writes_transposed_experts(transposed_families, world, spec):
    root = str(transposed_families)
    assert_same_files(read_merged(spec.live_folder(root)), hub_transposed(read_merged(spec.anchor_folder(root))))


def test_transposed_experts_packed_on_request(transposed_families, tmp_path):
    spec = TRANSPOSED[2][0]
    fsdpfast.merge(spec.ranks_folder(str(transposed_families)), tmp_path / "packed", expert_layout="packed")
    assert_same_files(read_merged(tmp_path / "packed"), read_merged(spec.anchor_folder(str(transposed_families))))


def test_transposed_experts_whose_shape_disagrees_with_config_are_refused(transposed_families, tmp_path):
    spec = TRANSPOSED[2][0]
    src = tmp_path / "ckpt"
    shutil.copytree(spec.ranks_folder(str(transposed_families)), src)
    path = src / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["moe_intermediate_size"] = 4  # the checkpoint packs 2I = 16 rows per expert
    path.write_text(json.dumps(config))
    api_refuses(src, tmp_path / "out", mentions=["gate_up_proj"])


def test_square_transposed_experts_are_written_with_a_warning(tmp_path):
    # moe_intermediate_size 16: 2I = H = 32, so gate_up_proj's matrices are square and transformers' loader,
    # which transposes only when the shape differs from its own, cannot tell the Hub's orientation
    spec = qwen3_vl_moe("square", 4)
    spec = FamilySpec(
        spec.name,
        spec.model_type,
        {**spec.config, "text_config": {**spec.config["text_config"], "moe_intermediate_size": 16}},
        seed=spec.seed,
        auto_class=spec.auto_class,
    )
    model = build_family_model(spec)
    src = tmp_path / "ckpt"
    model.config.save_pretrained(src / "huggingface")
    torch.save(model.state_dict(), src / "model_world_size_1_rank_0.pt")
    report = fsdpfast.merge(src, tmp_path / "out")
    assert any("square" in w and "expert_layout='packed'" in w for w in report.warnings), report.warnings
    merged = read_merged(tmp_path / "out")
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(merged[name], model.state_dict()[name].transpose(1, 2))
