"""torchtitan's own models, tiny, sharded by FSDP2 on gloo and saved by torchtitan's CheckpointManager, for the tests.

Each model is built from torchtitan 0.3's config builders (the ones its flavours use) with small
sizes, its weights initialised by torchtitan and then moved off their init values (norms of ones
would hide a misplaced row), sharded per layer and at the root, and saved as a resumable step-1
folder (model at the top level of the state dict, beside optimizer, lr_scheduler, train_state).
Rank 0 saves the unsharded state dict under torchtitan's names: the test hands it to torchtitan's
adapter (`to_hf`), the anchor. `hf_config` is the base model's config.json a run would start from.
torchtitan's model code imports triton: these need it installed (the CUDA wheels of torch bring it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch

from .framework_examples import TrainState
from .fsdp2_writer import _free_port, serve_rank

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")
_SIZES = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, vocab=128, hidden=96, experts=4, moe_hidden=32)


@dataclass(frozen=True)
class TitanSpec:
    name: str
    family: str  # one of FAMILIES
    seed: int = 0

    def folder(self, root: str) -> str:
        """The step folder a user gives to fsdpfast."""
        return os.path.join(root, self.name, "checkpoint", "step-1")

    def reference_path(self, root: str) -> str:
        return os.path.join(root, f"{self.name}.native.pt")


def titan_config(family: str):
    """The torchtitan model config (what its adapter is built with)."""
    s = _SIZES
    if family == "llama3":
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

        return Llama3Model.Config(
            dim=s["dim"],
            vocab_size=s["vocab"],
            tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"]),
            norm=RMSNorm.Config(normalized_shape=s["dim"]),
            lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"]),
            layers=_build_llama3_layers(
                n_layers=s["n_layers"],
                dim=s["dim"],
                n_heads=s["n_heads"],
                n_kv_heads=s["n_kv_heads"],
                hidden_dim=s["hidden"],
                rope=ComplexRoPE.Config(dim=s["head_dim"], max_seq_len=256, theta=500000, scaling="llama"),
                attn_backend="flex",
            ),
        )
    if family in ("qwen3", "qwen3_moe"):
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _build_qwen3_moe_layers, _qwen3_norm

        attention = dict(
            n_layers=s["n_layers"],
            dim=s["dim"],
            n_heads=s["n_heads"],
            n_kv_heads=s["n_kv_heads"],
            head_dim=s["head_dim"],
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=s["head_dim"], max_seq_len=256, theta=1000000.0),
        )
        if family == "qwen3":
            layers = _build_qwen3_layers(hidden_dim=s["hidden"], **attention)
        else:
            layers = _build_qwen3_moe_layers(
                moe_hidden_dim=s["moe_hidden"],
                num_experts=s["experts"],
                top_k=2,
                moe_comm_backend="standard",
                **attention,
            )
        return Qwen3Model.Config(
            vocab_size=s["vocab"],
            dim=s["dim"],
            norm=_qwen3_norm(s["dim"]),
            tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"]),
            lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"]),
            layers=layers,
        )
    if family == "deepseek_v3":
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers, _build_mtp_layers

        layers = _build_dsv3_layers(
            n_layers=s["n_layers"],
            n_dense_layers=1,
            dim=s["dim"],
            n_heads=s["n_heads"],
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            mscale=0.70,
            dense_hidden_dim=s["hidden"],
            moe_hidden_dim=s["moe_hidden"],
            num_experts=s["experts"],
            num_shared_experts=1,
            router_top_k=2,
            router_score_func="sigmoid",
            attn_backend="flex",
            moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=8, max_seq_len=256, theta=10000.0),
        )
        return DeepSeekV3Model.Config(
            vocab_size=s["vocab"],
            dim=s["dim"],
            tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"]),
            norm=RMSNorm.Config(normalized_shape=s["dim"]),
            lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"]),
            layers=layers,
            mtp_layers=_build_mtp_layers(layers[-1], dim=s["dim"], num_mtp_layers=1),
        )
    raise ValueError(f"no tiny torchtitan config for {family}")


def hf_config(family: str):
    """The base model's transformers config, of the same sizes."""
    s = _SIZES
    common = dict(
        hidden_size=s["dim"],
        num_hidden_layers=s["n_layers"],
        num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab"],
        tie_word_embeddings=False,
    )
    if family == "llama3":
        from transformers import LlamaConfig

        return LlamaConfig(
            architectures=["LlamaForCausalLM"], intermediate_size=s["hidden"], rms_norm_eps=1e-5, **common
        )
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(architectures=["Qwen3ForCausalLM"], intermediate_size=s["hidden"], **common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],
            intermediate_size=s["hidden"],
            moe_intermediate_size=s["moe_hidden"],
            num_experts=s["experts"],
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        common.update(num_key_value_heads=s["n_heads"], head_dim=8)
        return DeepseekV3Config(
            architectures=["DeepseekV3ForCausalLM"],
            intermediate_size=s["hidden"],
            moe_intermediate_size=s["moe_hidden"],
            n_routed_experts=s["experts"],
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_nextn_predict_layers=1,
            **common,
        )
    raise ValueError(f"no transformers config for {family}")


def write_titan_checkpoints(root: str, specs: list[TitanSpec], world_size: int) -> None:
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    port = _free_port()
    mp.spawn(_rank_main, args=(world_size, port, root, specs), nprocs=world_size, join=True)


def _rank_main(rank: int, world_size: int, port: int, root: str, specs: list[TitanSpec]) -> None:
    serve_rank(rank, world_size, port, "gloo", [partial(_write_one, rank, root, spec) for spec in specs])


def _write_one(rank: int, root: str, spec: TitanSpec) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    torch.manual_seed(spec.seed)
    model = titan_config(spec.family).build()
    model.init_states()
    generator = torch.Generator().manual_seed(1000 + spec.seed)
    with torch.no_grad():  # every element its own value, the same on every rank
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=2)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1)
    manager = CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": TrainState(1)},
        sd_adapter=None,
        base_folder=os.path.join(root, spec.name),
    )
    try:
        manager.save(curr_step=1)
    finally:
        manager.close()
    if rank == 0:
        torch.save(full, spec.reference_path(root))
