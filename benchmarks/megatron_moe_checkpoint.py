"""The checkpoints benchmarks/megatron_moe.py measures, written by real megatron-core, and megatron-bridge's export.

Runs in the megatron-core 0.16.1 / megatron-bridge 0.3.1 environment (how it is made: the docstring of
tests/fixtures/make_megatron_checkpoints.py), never in the project's:

    MEGATRON_PYTHON benchmarks/megatron_moe_checkpoint.py write CASE FOLDER
    MEGATRON_PYTHON benchmarks/megatron_moe_checkpoint.py bridge CASE FOLDER OUT TEMPLATE

`write`: CASE's model (CASES) built by megatron-core on gloo CPU ranks (its own random initialisation, bf16
parameters; the local spec's RMSNorm stays fp32, as in any bf16 local-spec checkpoint) and saved with
`dist_checkpointing.save` (torch_dist) as Megatron-LM lays it out: FOLDER/run/iter_0000001/ beside
FOLDER/run/latest_checkpointed_iteration.txt; FOLDER/hf/config.json is the matching Hugging Face config.
The CPU stand-ins (torch.cuda.synchronize, current_device) are the fixture script's.

`bridge`: megatron-bridge's export of FOLDER's checkpoint into OUT, as the fixture script makes its
reference: the model built at TP1/PP1 by bridge's provider for TEMPLATE (a Hugging Face folder of the
model: config.json and model.safetensors.index.json are all it reads; the index says which tensor goes to
which file), loaded with dist_checkpointing.load (which reshards), written by AutoBridge.save_hf_weights.
The provider skips the random initialisation (perform_initialization=False): every weight is loaded.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "fixtures"))
import make_megatron_checkpoints as fixtures  # noqa: E402  (the CPU recipe: free port, bridge import)

ITERATION = 1
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    tp: int
    ep: int
    hidden: int
    layers: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    ffn: int  # the dense MLP's (Qwen3-MoE: config.json's intermediate_size, unused with no dense layer)
    experts: int = 0
    moe_ffn: int = 0
    topk: int = 0
    gpt_oss: bool = False

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)  # expert parallel inside the tensor-parallel ranks, as the fixtures' tp2_ep2

    @property
    def parameters(self) -> int:
        h, att = self.hidden, self.heads * self.head_dim
        attention = (att + 2 * self.groups * self.head_dim) * h + att * h
        mlp = self.experts * 3 * self.moe_ffn * h + self.experts * h if self.experts else 3 * self.ffn * h
        return self.layers * (attention + mlp) + 2 * self.vocab * h


# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query heads and 4 KV groups of 128, experts of 768) with 8 layers,
# 16 experts and a 64k vocabulary: 1.02 B parameters, 2.05 GB in bf16. TP2 for attention, EP2 for the experts.
QWEN3_MOE = Case(
    tp=2,
    ep=2,
    hidden=2048,
    layers=8,
    heads=32,
    groups=4,
    head_dim=128,
    vocab=65536,
    ffn=6144,
    experts=16,
    moe_ffn=768,
    topk=4,
)
CASES = {
    "qwen3_moe": QWEN3_MOE,
    # its dense twin (megatron-bridge 0.3.1 cannot export SequentialMLP experts): a dense MLP of the experts' size
    "qwen3_dense": dataclasses.replace(QWEN3_MOE, ep=1, ffn=12288, experts=0, moe_ffn=0, topk=0),
    # gpt-oss's layer shapes (hidden 2880, 64 query heads and 8 KV groups of 64, experts of 2880: gate_up_proj
    # [E, 2880, 5760]) with 2 layers, 16 experts and a 32k vocabulary: 1.03 B parameters
    "gpt_oss": Case(
        tp=1,
        ep=1,
        hidden=2880,
        layers=2,
        heads=64,
        groups=8,
        head_dim=64,
        vocab=32000,
        ffn=2880,
        experts=16,
        moe_ffn=2880,
        topk=4,
        gpt_oss=True,
    ),
}


def _cpu_only() -> None:
    torch.cuda.synchronize = lambda *a, **k: None  # CPU-only torch: see the fixture script's doc
    torch.cuda.current_device = lambda: "cpu"


def _config(case: Case):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if case.experts:
        moe = dict(
            num_moe_experts=case.experts,
            moe_ffn_hidden_size=case.moe_ffn,
            moe_router_topk=case.topk,
            moe_router_pre_softmax=False,
            moe_grouped_gemm=False,  # SequentialMLP and the allgather dispatcher: the ones that run on a CPU
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=case.ep,
            expert_tensor_parallel_size=1,  # the experts whole on their EP rank (megatron's default is the TP size)
        )
    config = TransformerConfig(
        num_layers=case.layers,
        hidden_size=case.hidden,
        ffn_hidden_size=case.ffn,
        num_attention_heads=case.heads,
        num_query_groups=case.groups,
        kv_channels=case.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=EPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=case.tp,
        qk_layernorm=not case.gpt_oss,
        **moe,
    )
    if case.gpt_oss:  # megatron-bridge 0.3.1's gpt-oss provider settings (as the gpt-oss fixture)
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        config = dataclasses.replace(
            config,
            add_bias_linear=True,
            activation_func=quick_gelu,
            activation_func_clamp_value=7.0,
            glu_linear_offset=1.0,
            softmax_type="learnable",
            window_size=(128, 0),
            window_attn_skip_freq=2,
        )
    return config


def _write_worker(rank: int, world: int, case: Case, run_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _cpu_only()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.tp, expert_model_parallel_size=case.ep, expert_tensor_parallel_size=1
    )
    torch.manual_seed(1234)
    config = _config(case)
    spec = get_gpt_layer_local_spec(
        num_experts=case.experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=not case.gpt_oss,
        normalization="RMSNorm",
    )
    model = GPTModel(
        config,
        spec,
        vocab_size=case.vocab,
        max_sequence_length=4096,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        parallel_output=False,
    )
    checkpoint = os.path.join(run_dir, f"iter_{ITERATION:07d}")
    if rank == 0:
        os.makedirs(checkpoint)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), checkpoint)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(run_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.destroy_process_group()


def _hf_config(case: Case):
    import transformers

    common = dict(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        intermediate_size=case.ffn,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.groups,
        head_dim=case.head_dim,
        rms_norm_eps=EPS,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    if case.gpt_oss:
        config = transformers.GptOssConfig(
            num_local_experts=case.experts,
            num_experts_per_tok=case.topk,
            sliding_window=128,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(case.layers)],
            attention_bias=True,
            swiglu_limit=7.0,
            rope_scaling=None,  # Megatron's plain RoPE here, not gpt-oss's YaRN
            **common,
        )
    elif case.experts:
        config = transformers.Qwen3MoeConfig(
            num_experts=case.experts,
            moe_intermediate_size=case.moe_ffn,
            num_experts_per_tok=case.topk,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            hidden_act="silu",
            **common,
        )
    else:
        config = transformers.Qwen3Config(attention_bias=False, hidden_act="silu", **common)
    config.torch_dtype = "bfloat16"
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}  # as the fixtures' (transformers 5)
    return config


def write(name: str, folder: str) -> None:
    case = CASES[name]
    run_dir = os.path.join(folder, "run")
    os.makedirs(run_dir)
    torch.multiprocessing.spawn(
        _write_worker, args=(case.world, case, run_dir, fixtures._free_port()), nprocs=case.world
    )
    _hf_config(case).save_pretrained(os.path.join(folder, "hf"))


def bridge(name: str, folder: str, out: str, template: str) -> None:
    case = CASES[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(fixtures._free_port()))
    _cpu_only()
    auto_bridge = fixtures._import_bridge()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    bridged = auto_bridge.from_hf_pretrained(template)
    provider = bridged.to_megatron_provider(load_weights=False)
    settings = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=torch.bfloat16,
        bf16=True,
        fp16=False,
        make_vocab_size_divisible_by=1,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=case.experts or None,
            moe_grouped_gemm=False,
            qk_layernorm=not case.gpt_oss,
            normalization="RMSNorm",
        ),
    )
    if case.experts:
        settings.update(  # bridge's Qwen3-MoE provider asks for Transformer Engine's fused permutation
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_permute_fusion=False,
            expert_model_parallel_size=1,
        )
    for key, value in settings.items():
        setattr(provider, key, value)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide()
    state = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(folder, "run", f"iter_{ITERATION:07d}"))
    model.load_state_dict(state)
    bridged.save_hf_weights([model], out, show_progress=False)
    dist.destroy_process_group()


if __name__ == "__main__":  # required: the async writer starts a spawn Manager
    what, *args = sys.argv[1:]
    {"write": write, "bridge": bridge}[what](*args)
