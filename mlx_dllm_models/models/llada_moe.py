"""LLaDA-MoE-7B-A1B (`LLaDAMoEModelLM`): an OLMoE / Qwen3-MoE-like body (`model.layers.N.*`) read
bidirectionally. Its checkpoints write model_type "llada", as LLaDA 8B's do (dllm's instructions
rewrite it to "lladamoe"): models/llada.py tells the two apart and builds this body, with the
family's spec, for an MoE config.

Router, as read in the HF remote code (ZHZisZZ/dllm copy of `modeling_lladamoe.py`,
`LLaDAMoESparseMoeBlock`): `softmax(gate(x))` in float32, `+ expert_bias` when
`moe_router_enable_expert_bias` (the biased values are both ranked and used as weights), top-k,
no renormalisation (`norm_topk_prob` is hard-coded False whatever the config says),
`routed_scaling_factor` stored in the config but never applied, `moe_router_score_function`
stored but never read (always softmax). The shared expert lives on the decoder layer
(`model.layers.N.shared_expert.*`, not under `mlp`) and is added to the routed output. q/k norms
are RMSNorms over head_dim (per head) before RoPE; `clip_qkv` clamps after them; head_dim is
always hidden_size // num_attention_heads.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models import llama
from mlx_lm.models.base import BaseModelArgs, scaled_dot_product_attention
from mlx_lm.models.qwen3_moe import MLP
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.switch_layers import SwitchGLU

from . import sharding
from .common import (
    check_context_length,
    check_special_ids,
    check_weights,
    masked_forward,
)

# LLaDA-MoE's <|mask|>: the id its generate uses when config.json names none.
LLADA_MOE_MASK_ID = 156895

# What `check_weights` says the checkpoint holds, and which config.json fields decide it.
LAYOUT = "LLaDAMoEModelLM's layout (e.g. 'model.layers.1.mlp.experts.0.up_proj.weight')"
CONFIG_KEYS = (
    "num_hidden_layers, moe_layer_freq, num_experts, *_intermediate_size, "
    "moe_router_enable_expert_bias, hidden_size, head counts, vocab_size"
)


def is_moe_config(config: dict) -> bool:
    """Whether a model_type "llada" config.json describes LLaDA-MoE: its `architectures` name
    an MoE class, or it has experts."""
    archs = config.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    return config.get("num_experts") is not None or any("MoE" in a for a in archs)


def require(args, names: Sequence[str], variant: str) -> None:
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        raise ValueError(f"config.json of a {variant} checkpoint lacks {', '.join(missing)}")


@dataclass
class SharedArgs(BaseModelArgs):
    """The config.json fields LLaDA 8B and LLaDA-MoE read under the same names."""

    model_type: str = "llada"
    architectures: Optional[List[str]] = None
    vocab_size: Optional[int] = None
    rope_theta: Optional[float] = None
    rms_norm_eps: float = 1e-5
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, List[int]]] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: bool = False


@dataclass
class ModelArgs(SharedArgs):
    hidden_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    dense_intermediate_size: Optional[int] = None
    expert_intermediate_size: Optional[int] = None
    shared_expert_intermediate_size: Optional[int] = None
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_layer_freq: Optional[Union[int, List[int]]] = None
    qk_layernorm: bool = True
    partial_rotary_factor: float = 1.0
    rope_scaling: Optional[Dict[str, Any]] = None
    attention_bias: bool = False
    clip_qkv: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    hidden_act: str = "silu"

    # What the family's spec and LLaDA 8B's args tell apart.
    is_moe = True

    def __post_init__(self):
        if self.mask_token_id is None:
            # No quote of LLaDA-MoE's config.json shows a mask_token_id (tests/data/README.md);
            # its model card's generate hard-codes mask_id=156895 (<|mask|>), as llama.cpp does.
            self.mask_token_id = LLADA_MOE_MASK_ID
        require(
            self,
            (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_experts",
                "num_experts_per_tok",
                "expert_intermediate_size",
                "vocab_size",
            ),
            "LLaDAMoEModelLM",
        )
        if self.hidden_act != "silu":
            raise ValueError(
                f"LLaDA-MoE hidden_act={self.hidden_act!r} is not supported (only silu)"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_theta is None:
            self.rope_theta = 50000.0
        n = self.num_hidden_layers
        freq = self.moe_layer_freq
        if freq is None:
            freq = [1] * n
        elif isinstance(freq, int):
            # The reference indexes a per-layer list; a scalar is read as the same value everywhere.
            freq = [freq] * n
        if len(freq) != n:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries for {n} layers")
        self.moe_layer_freq = [int(f) for f in freq]
        if any(f == 0 for f in freq) and self.dense_intermediate_size is None:
            raise ValueError(
                "moe_layer_freq has dense layers but config.json lacks dense_intermediate_size"
            )
        check_special_ids(self)
        check_context_length(
            self.model_type, "max_position_embeddings", self.max_position_embeddings
        )

    def llama_args(self) -> llama.ModelArgs:
        """The same attention geometry in mlx-lm's Llama terms, to build its layers."""
        return llama.ModelArgs(
            model_type="llama",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.dense_intermediate_size or self.expert_intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            attention_bias=self.attention_bias,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )


class MoEAttention(llama.Attention):
    """Llama attention plus per-head q/k RMSNorm before a (possibly partial) NeoX RoPE."""

    def __init__(self, args: ModelArgs):
        largs = args.llama_args()
        super().__init__(largs)
        self.rope = initialize_rope(
            int(self.head_dim * args.partial_rotary_factor),
            largs.rope_theta,
            False,
            largs.rope_scaling,
            largs.max_position_embeddings,
        )
        if args.qk_layernorm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.clip_qkv = args.clip_qkv

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (mx.clip(t, -self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(
            args.hidden_size, args.expert_intermediate_size, args.num_experts
        )
        if args.moe_router_enable_expert_bias:
            self.expert_bias = mx.zeros((args.num_experts,))
        # Set by Model.shard: the experts are split over the group, their outputs summed here.
        self.sharding_group = None

    def __call__(self, x):
        if self.sharding_group is not None:
            x = sum_gradients(self.sharding_group)(x)
        scores = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        if "expert_bias" in self:
            scores = scores + self.expert_bias.astype(mx.float32)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k])
        weights = mx.take_along_axis(scores, inds, axis=-1).astype(x.dtype)
        y = (self.switch_mlp(x, inds) * weights[..., None]).sum(axis=-2)
        if self.sharding_group is not None:
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y


class MoEDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = MoEAttention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.moe_layer_freq[layer_idx]:
            self.mlp = SparseMoeBlock(args)
            if args.shared_expert_intermediate_size is not None:
                self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
        else:
            self.mlp = MLP(args.hidden_size, args.dense_intermediate_size)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        r = self.post_attention_layernorm(h)
        out = self.mlp(r)
        if "shared_expert" in self:
            out = out + self.shared_expert(r)
        return h + out


class LLaDAMoEBody(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [MoEDecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """LLaDAMoEModelLM's weights and forward under the caller's mask; models/llada.py adds the
    family's spec (its MoEModel)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LLaDAMoEBody(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        return masked_forward(self, self.model.embed_tokens, inputs, cache, mask, head_span)

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights):
        origin = {k: k for k in weights}
        weights = {k: v for k, v in weights.items() if not k.endswith("inv_freq")}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        self.stack_experts(weights, origin)
        return check_weights(self, weights, "llada", LAYOUT, CONFIG_KEYS, origin)

    def to_hf_weights(self, weights):
        """The checkpoint's names, the inverse of `sanitize`: LLaDA-MoE keeps the converted
        (stacked-expert) names, which `sanitize` reads as well."""
        return dict(weights)

    def stack_experts(self, weights, origin):
        n_experts = self.args.num_experts
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}.mlp"
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue
            if f"{prefix}.experts.0.up_proj.weight" not in weights:
                continue  # already stacked (a converted checkpoint)
            for name in ("gate_proj", "up_proj", "down_proj"):
                keys = [f"{prefix}.experts.{e}.{name}.weight" for e in range(n_experts)]
                missing = [k for k in keys if k not in weights]
                if missing:
                    raise ValueError(
                        f"{missing[0]} is missing: config.json says num_experts={n_experts}"
                    )
                stacked = f"{prefix}.switch_mlp.{name}.weight"
                weights[stacked] = mx.stack([weights.pop(k) for k in keys])
                origin[stacked] = f"{prefix}.experts.*.{name}.weight"

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism over `group` as qwen3_moe.Model.shard: attention heads, dense MLPs
        and the shared expert split, the routed experts split over their intermediate dimension;
        router and expert_bias replicated."""
        widths = (
            "expert_intermediate_size",
            "dense_intermediate_size",
            "shared_expert_intermediate_size",
        )
        group = sharding.checked_gqa_group(self, group, "llada", *widths)
        for layer in self.layers:
            sharding.shard_attention(layer.self_attn, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.sharding_group = group
                sharding.shard_mlp_inplace(layer.mlp.switch_mlp, group, "llada")
            else:
                sharding.shard_mlp(layer.mlp, group)
            if "shared_expert" in layer:
                sharding.shard_mlp(layer.shared_expert, group)
