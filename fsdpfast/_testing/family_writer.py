"""Tiny models of today's families (transformers 5 classes), sharded by real FSDP2 on gloo ranks.

Each spec builds one family's model from a transformers config with small sizes, initialised
from a seed, so every rank builds the same one. Rank 0 first writes the anchor: the unsharded
model's own `save_pretrained` (the Hub layout transformers writes: per-expert names for the MoE
families it converts, its dtype rules). Then FSDP2 shards every decoder layer and the root, and
each rank saves its state dict as verl's rank files (`model_world_size_W_rank_R.pt`, config
files in `huggingface/`), and the same state dict as a DCP folder (`dcp/`, config.json beside
`.metadata` in `dcp/huggingface/`), and writes the sharded model with fsdpfast.save_pretrained
(`live/`, the Hub layout). No training step: the initial weights are random per
element, which is what a byte placement test needs, and MoE routing on CPU adds nothing here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .fsdp2_writer import spawn_writers

# Small sizes every family takes; each spec adds its own.
_SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=96,
    max_position_embeddings=64,
)

# The sizes of each family's tiny model the tests use (its own config keys beside _SMALL's).
DEEPSEEK_V3 = dict(
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_group=1,
    topk_group=1,
)
TEXT = _SMALL  # a vision-language model's text_config
QWEN2_5_VL = dict(
    text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
    vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0]
    ),
)
# a ViT of one layer over 2x2 patches of 14 pixels (Gemma 3's SigLIP, Llama 4's, Mistral 3's Pixtral, LLaVA's CLIP)
VISION_TOWER = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32)  # Qwen3-VL's, Qwen3.5's
QWEN3_VL = dict(
    text_config=dict(TEXT, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]}), vision_config=VISION
)
# Qwen3.5-MoE: a linear-attention (gated delta net) layer and a full-attention one, 4 experts and a shared expert
QWEN3_5_MOE_TEXT = dict(
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
)
QWEN3_5_MOE = dict(text_config=dict(TEXT, **QWEN3_5_MOE_TEXT), vision_config=VISION)
LLAMA4 = dict(
    text_config=dict(
        TEXT, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1
    ),
    vision_config=dict(VISION_TOWER, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32),
)
MISTRAL3 = dict(
    text_config=dict(TEXT, model_type="mistral"),
    vision_config=dict(VISION_TOWER, head_dim=16),
    spatial_merge_size=1,
)
LLAVA = dict(
    text_config=dict(TEXT, model_type="llama"),
    vision_config=dict(VISION_TOWER, model_type="clip_vision_model", num_hidden_layers=2, projection_dim=32),
    vision_feature_layer=-1,
)
ENCODER = dict(  # BERT's and ModernBERT's small sizes
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    vocab_size=96,
    max_position_embeddings=64,
)
GEMMA3 = dict(
    text_config=TEXT,
    vision_config=VISION_TOWER,
    mm_tokens_per_image=4,
)


@dataclass(frozen=True)
class FamilySpec:
    name: str  # sub-folder of the root folder
    model_type: str  # transformers' config model_type
    config: dict = field(default_factory=dict)  # the family's own sizes (experts, ...)
    dtype: str = "float32"
    seed: int = 0
    auto_class: str = "AutoModelForCausalLM"  # AutoModelForImageTextToText for a vision-language model

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)

    def ranks_folder(self, root: str) -> str:
        return os.path.join(root, self.name, "ranks")

    def dcp_folder(self, root: str) -> str:
        return os.path.join(root, self.name, "dcp")

    def live_folder(self, root: str) -> str:
        """fsdpfast.save_pretrained of the sharded model."""
        return os.path.join(root, self.name, "live")

    def anchor_folder(self, root: str) -> str:
        """The unsharded model's save_pretrained."""
        return os.path.join(root, self.name, "save_pretrained")


def family_config(spec: FamilySpec):
    import transformers

    sizes = {**_SMALL, **spec.config} if spec.auto_class == "AutoModelForCausalLM" else spec.config
    config = transformers.AutoConfig.for_model(spec.model_type, **sizes)
    config.dtype = getattr(torch, spec.dtype)
    return config


def build_family_model(spec: FamilySpec):
    import transformers

    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.auto_class).from_config(family_config(spec))
    return model.to(getattr(torch, spec.dtype))


def write_family_checkpoints(root: str, specs: list[FamilySpec], world_size: int) -> None:
    spawn_writers(root, specs, world_size, _write_one)


def _write_one(rank: int, world_size: int, root: str, spec: FamilySpec) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_family_model(spec)
    if rank == 0:
        model.save_pretrained(spec.anchor_folder(root))
        for folder in (spec.ranks_folder(root), spec.dcp_folder(root)):
            model.config.save_pretrained(os.path.join(folder, "huggingface"))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in _blocks(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    os.makedirs(spec.ranks_folder(root), exist_ok=True)
    torch.save(state, os.path.join(spec.ranks_folder(root), f"model_world_size_{world_size}_rank_{rank}.pt"))
    dcp.save(state, checkpoint_id=spec.dcp_folder(root))
    import fsdpfast  # the live save of the same sharded model, in the Hub layout

    fsdpfast.save_pretrained(model, spec.live_folder(root))


def _blocks(model) -> list:
    """Every decoder (and vision) block: the members of each ModuleList named `layers` or `blocks`."""
    return [
        block
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in ("layers", "blocks") and isinstance(module, torch.nn.ModuleList)
        for block in module
    ]


@dataclass(frozen=True)
class Fsdp1FamilySpec:
    """A family's tiny model wrapped by FSDP1 (FullyShardedDataParallel, one unit per decoder layer, the
    model's _no_split_modules, and the root; device_id=cpu on gloo), saved live by fsdpfast.save_pretrained
    (`live/`, and `live-bf16/` cast), and as FSDP1 LOCAL_STATE_DICT rank files with config.json
    (`fsdp1/`, for the offline fsdp1-flat merge)."""

    family: FamilySpec
    use_orig_params: bool

    @property
    def name(self) -> str:
        return self.family.name


def write_family_fsdp1_saves(root: str, specs: list[Fsdp1FamilySpec], world_size: int) -> None:
    spawn_writers(root, specs, world_size, _write_one_fsdp1)


def _write_one_fsdp1(rank: int, world_size: int, root: str, spec: Fsdp1FamilySpec) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import fsdpfast

    from .fsdp1_examples import FILE_NAME, wrap_classes

    model = build_family_model(spec.family)
    folder = os.path.join(spec.family.folder(root), "fsdp1")
    if rank == 0:
        model.save_pretrained(spec.family.anchor_folder(root))
        model.config.save_pretrained(folder)
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy(wrap_classes(model, ())),
        use_orig_params=spec.use_orig_params,
        device_id=torch.device("cpu"),
    )
    fsdpfast.save_pretrained(wrapped, spec.family.live_folder(root))
    fsdpfast.save_pretrained(wrapped, spec.family.live_folder(root) + "-bf16", dtype="bf16")
    with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.LOCAL_STATE_DICT):
        local = wrapped.state_dict()
    os.makedirs(folder, exist_ok=True)
    torch.save(local, os.path.join(folder, FILE_NAME.format(rank=rank)))


def write_family_accelerate_saves(root: str, specs: list[FamilySpec], world_size: int) -> None:
    """Each family's tiny model prepared by accelerate with FSDP2 on gloo ranks (framework_examples' CPU
    Accelerator, its decoder-layer class wrapped), saved by accelerate's own `save_fsdp_model(...,
    use_dcp=False)` (`accelerate-ranks/`: pytorch_model_fsdp_0_rank{r}.bin, config.json beside them) and
    `Accelerator.save_state` (`accelerate-state/`: a DCP folder); `save_pretrained/` is the anchor."""
    import torch.multiprocessing as mp

    from .fsdp2_writer import _free_port

    os.makedirs(root, exist_ok=True)
    mp.spawn(_accelerate_rank, args=(world_size, _free_port(), root, specs), nprocs=world_size, join=True)


def _accelerate_rank(rank: int, world_size: int, port: int, root: str, specs: list[FamilySpec]) -> None:
    from functools import partial

    from .framework_examples import launched_environment
    from .fsdp2_writer import serve_rank

    launched_environment(rank, world_size, port)
    serve_rank(rank, world_size, port, "gloo", [partial(_write_one_accelerate, rank, root, spec) for spec in specs])


def _write_one_accelerate(rank: int, root: str, spec: FamilySpec) -> None:
    from accelerate.utils import save_fsdp_model

    from .framework_examples import _accelerator

    model = build_family_model(spec)
    ranks, state = (
        os.path.join(spec.folder(root), "accelerate-ranks"),
        os.path.join(spec.folder(root), "accelerate-state"),
    )
    if rank == 0:
        model.save_pretrained(spec.anchor_folder(root))
        for folder in (ranks, state):
            model.config.save_pretrained(folder)
    accelerator = _accelerator(2, "SHARDED_STATE_DICT", tuple(model._no_split_modules))
    # FSDP2 under accelerate takes the optimizer with the model (no step is taken: the weights stay the anchor's)
    prepared, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, prepared, ranks, use_dcp=False)
    accelerator.save_state(state)
