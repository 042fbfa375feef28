"""LLaDA 8B (`LLaDAModelLM`) and LLaDA-MoE-7B-A1B (`LLaDAMoEModelLM`), both `model_type "llada"`.

LLaDA 8B is a Llama body under OLMo names (`model.transformer.blocks.N.*`); LLaDA-MoE is an OLMoE /
Qwen3-MoE-like body (`model.layers.N.*`). The config's `architectures` (or the presence of
`num_experts`) picks the body. Both attend bidirectionally: `mask=None` means every query sees
every key, and logits at position i predict token i (no shift).

LLaDA-MoE router, as read in the HF remote code (ZHZisZZ/dllm copy of `modeling_lladamoe.py`,
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
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models import llama
from mlx_lm.models.base import BaseModelArgs, scaled_dot_product_attention
from mlx_lm.models.qwen3_moe import MLP
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.switch_layers import SwitchGLU

from ..spec import BIDIRECTIONAL, MASK_COUNT_ELBO, SHARED_SAMPLERS, DiffusionSpec
from . import sharding
from .common import (
    build_spec,
    cached_spec,
    check_context_length,
    check_special_ids,
    check_weights,
    masked_forward,
    refuse_autoregressive_tools,
)
from .llada_settings import FAMILY, SETTINGS

# LLaDA generate.py / Fast-dLLM settings, in this package's vocabulary (steps are per block).
REFERENCE_DEFAULTS = {
    "block_length": 32,
    "sampler": "quota",
    "temperature": 0.0,
    "threshold": 0.9,
    "factor": 1.0,
    "entropy_bound": 0.1,
    "max_tokens": 128,
    # generate.py's options, off as upstream's defaults.
    "cfg_scale": 0.0,
    "logits_eos_inf": False,
    "confidence_eos_eot_inf": False,
}

# generate.py's remasking="random" is the sampler "random" (decoding.llada.random_commit); "d3llm"
# is d3LLM's generate_multi_block (decoding.d3llm), the decoder of its distilled d3LLM_LLaDA.
# config.json's model_type of LLaDA 8B's checkpoints (tiny.llada_config writes it).
MODEL_TYPE = "llada"

LLADA_SAMPLERS = SHARED_SAMPLERS + ("random", "d3llm")
# d3LLM's recipe for d3LLM_LLaDA (chat/chat_d3llm_llada.py and eval_scripts/llada_gsm8k_cot.sh's
# generate_multi_block run): 256 tokens, blocks of 32, entropy threshold 0.5, the next block at
# 10% of the last, full activation at 95% of the previous, early stop at EOS, greedy. Its whole
# canvas is the engine's one block.
D3LLM_DEFAULTS = {
    "block_length": None,
    "max_tokens": 256,
    "block_size": 32,
    "threshold": 0.5,
    "block_add_threshold": 0.1,
    "decoded_token_threshold": 0.95,
    "early_stop": True,
    "temperature": 0.0,
}

# The end-of-turn token that confidence_eos_eot_inf scores 0 (generate.py hard-codes 126348, LLaDA
# 8B's <|eot_id|>), by name, resolved through the checkpoint's tokenizer; LLaDA-MoE's chat template
# ends a turn with <|role_end|>.
EOT_TOKENS = ("<|eot_id|>", "<|role_end|>")


# LLaDA-MoE's <|mask|>: the id its generate uses when config.json names none.
LLADA_MOE_MASK_ID = 156895


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "llada"
    architectures: Optional[List[str]] = None
    vocab_size: Optional[int] = None
    rope_theta: Optional[float] = None
    rms_norm_eps: float = 1e-5
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, List[int]]] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    # LLaDA 8B (OLMo field names)
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    multi_query_attention: Optional[bool] = None
    mlp_hidden_size: Optional[int] = None
    mlp_ratio: int = 4
    embedding_size: Optional[int] = None
    max_sequence_length: Optional[int] = None
    include_bias: bool = False
    include_qkv_bias: bool = False
    weight_tying: bool = False
    scale_logits: bool = False
    block_type: str = "llama"
    rope: bool = True
    alibi: bool = False
    attention_layer_norm: bool = False
    activation_type: str = "silu"
    layer_norm_type: str = "rms"
    input_emb_norm: bool = False
    # LLaDA-MoE (OLMoE / Qwen3-MoE-like field names)
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
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        archs = self.architectures or ()
        if isinstance(archs, str):
            archs = (archs,)
        # Both architectures say model_type "llada"; the MoE one is told apart by its body.
        self.is_moe = self.num_experts is not None or any("MoE" in a for a in archs)
        if self.mask_token_id is None and self.is_moe:
            # No quote of LLaDA-MoE's config.json shows a mask_token_id (tests/data/README.md);
            # its model card's generate hard-codes mask_id=156895 (<|mask|>), as llama.cpp does.
            self.mask_token_id = LLADA_MOE_MASK_ID
        if self.mask_token_id is None:
            raise ValueError(
                f"{self.model_type}: checkpoint has no mask_token_id; add it to config.json "
                "(126336, <|mdm_mask|>, for LLaDA-8B; 156895, <|mask|>, for LLaDA-MoE)"
            )
        if self.is_moe:
            self._check_moe()
        else:
            self._check_dense()
        check_special_ids(self)
        for key in ("max_sequence_length", "max_position_embeddings"):
            check_context_length(self.model_type, key, getattr(self, key))

    def _require(self, names, variant):
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"config.json of a {variant} checkpoint lacks {', '.join(missing)}")

    def _check_dense(self):
        self._require(("d_model", "n_layers", "n_heads", "vocab_size"), "LLaDAModelLM")
        unsupported = {
            "block_type": (self.block_type, "llama"),
            "activation_type": (self.activation_type, "silu"),
            "layer_norm_type": (self.layer_norm_type, "rms"),
            "rope": (self.rope, True),
            "alibi": (self.alibi, False),
            "attention_layer_norm": (self.attention_layer_norm, False),
            "input_emb_norm": (self.input_emb_norm, False),
        }
        for name, (value, wanted) in unsupported.items():
            if value != wanted:
                raise ValueError(
                    f"LLaDA config {name}={value!r} is not supported (only the LLaDA 8B layout, "
                    f"{name}={wanted!r}, is implemented)"
                )
        if self.n_kv_heads is None:
            self.n_kv_heads = 1 if self.multi_query_attention else self.n_heads
        if self.mlp_hidden_size is None:
            self.mlp_hidden_size = self.mlp_ratio * self.d_model
        if self.rope_theta is None:
            self.rope_theta = 10000.0
        self.tie_word_embeddings = self.weight_tying

    def _check_moe(self):
        self._require(
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

    @property
    def dims(self) -> int:
        return self.hidden_size if self.is_moe else self.d_model

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers if self.is_moe else self.n_layers

    @property
    def rows_of_vocab(self) -> int:
        # OLMo sizes wte and the head by embedding_size (padded vocabulary) when it is set.
        if self.is_moe:
            return self.vocab_size
        return self.embedding_size or self.vocab_size

    def llama_args(self) -> llama.ModelArgs:
        """The same attention geometry in mlx-lm's Llama terms, to build its layers."""
        if self.is_moe:
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
        return llama.ModelArgs(
            model_type="llama",
            hidden_size=self.d_model,
            num_hidden_layers=self.n_layers,
            intermediate_size=self.mlp_hidden_size,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            head_dim=self.d_model // self.n_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.rows_of_vocab,
            attention_bias=self.include_bias or self.include_qkv_bias,
            mlp_bias=self.include_bias,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_sequence_length,
        )


def _dense_block(args: ModelArgs) -> llama.TransformerBlock:
    block = llama.TransformerBlock(args.llama_args())
    if args.include_qkv_bias and not args.include_bias:
        # OLMo gives q/k/v a bias under include_qkv_bias but attn_out only under include_bias.
        block.self_attn.o_proj = nn.Linear(args.d_model, args.d_model, bias=False)
    return block


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


class LLaDABody(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.rows_of_vocab, args.dims)
        if args.is_moe:
            self.layers = [MoEDecoderLayer(args, i) for i in range(args.num_layers)]
        else:
            self.layers = [_dense_block(args) for _ in range(args.num_layers)]
        self.norm = nn.RMSNorm(args.dims, eps=args.rms_norm_eps)


# HF LLaDA 8B names -> this module's names.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",  # the SiLU branch
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_TOP_NAMES = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}
_OLMO_PREFIX = "model.transformer."


def _rename_olmo(key: str) -> str:
    if not key.startswith(_OLMO_PREFIX):
        return key
    parts = key[len(_OLMO_PREFIX) :].split(".")
    if len(parts) == 4 and parts[0] == "blocks" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return key  # left for the unknown-key check


# Public: LaViDa's checkpoints (models/llava_llada.py) name their language model as LLaDA 8B does.
rename_olmo = _rename_olmo


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LLaDABody(args)
        if not args.tie_word_embeddings:
            head_bias = args.include_bias and not args.is_moe
            self.lm_head = nn.Linear(args.dims, args.rows_of_vocab, bias=head_bias)

    # mlx-lm's AR tools call make_cache first: they stop there with a pointer to mlx_dllm.
    make_cache = refuse_autoregressive_tools

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        logits = masked_forward(self, self.model.embed_tokens, inputs, cache, mask, head_span)
        if self.args.scale_logits and not self.args.is_moe:
            logits = logits * (self.args.d_model**-0.5)
        return logits

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights):
        origin = {_rename_olmo(k): k for k in weights}
        weights = {_rename_olmo(k): v for k, v in weights.items() if not k.endswith("inv_freq")}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        if self.args.is_moe:
            self._stack_experts(weights, origin)
            layout = "LLaDAMoEModelLM's layout (e.g. 'model.layers.1.mlp.experts.0.up_proj.weight')"
            keys = (
                "num_hidden_layers, moe_layer_freq, num_experts, *_intermediate_size, "
                "moe_router_enable_expert_bias, hidden_size, head counts, vocab_size"
            )
        else:
            layout = "LLaDAModelLM's OLMo layout (e.g. 'model.transformer.blocks.0.ff_proj.weight')"
            keys = (
                "n_layers, d_model, n_heads, n_kv_heads, mlp_hidden_size, include_bias, "
                "include_qkv_bias, weight_tying, vocab_size / embedding_size"
            )
        return check_weights(self, weights, "llada", layout, keys, origin)

    def to_hf_weights(self, weights):
        """This module's names -> the checkpoint's, the inverse of `sanitize`, to save a trained
        model in its family's layout: LLaDA 8B's OLMo names. LLaDA-MoE keeps the converted
        (stacked-expert) names, which `sanitize` reads as well."""
        if self.args.is_moe:
            return dict(weights)
        block = {v: k for k, v in _BLOCK_NAMES.items()}
        top = {v: k for k, v in _TOP_NAMES.items()}
        out = {}
        for key, value in weights.items():
            module, _, leaf = key.rpartition(".")
            if module.startswith("model.layers."):
                _, _, i, rest = module.split(".", 3)
                out[f"{_OLMO_PREFIX}blocks.{i}.{block[rest]}.{leaf}"] = value
            elif module in top:
                out[f"{_OLMO_PREFIX}{top[module]}.{leaf}"] = value
            else:
                raise ValueError(f"llada: no LLaDA 8B (OLMo) name for weight {key!r}")
        return out

    def _stack_experts(self, weights, origin):
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
        """Tensor parallelism over `group`: LLaDA 8B as mlx-lm's llama.Model.shard; LLaDA-MoE as
        qwen3_moe.Model.shard (attention heads, dense MLPs and the shared expert split, the
        routed experts split over their intermediate dimension; router and expert_bias
        replicated)."""
        group = sharding.group_of(group)
        a = self.args
        if not a.is_moe:
            sizes = {"n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads}
            sharding.check_divisible(
                "llada", group, dict(sizes, mlp_hidden_size=a.mlp_hidden_size), model=self
            )
            return llama.Model.shard(self, group)
        sizes = {"num_attention_heads": a.num_attention_heads}
        for name in (
            "expert_intermediate_size",
            "dense_intermediate_size",
            "shared_expert_intermediate_size",
        ):
            if getattr(a, name) is not None:
                sizes[name] = getattr(a, name)
        kv = {"num_key_value_heads": a.num_key_value_heads}
        sharding.check_divisible("llada", group, sizes, kv, model=self)
        for layer in self.layers:
            sharding.shard_attention(layer.self_attn, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.sharding_group = group
                sharding.shard_mlp_inplace(layer.mlp.switch_mlp, group, "llada")
            else:
                sharding.shard_mlp(layer.mlp, group)
            if "shared_expert" in layer:
                sharding.shard_mlp(layer.shared_expert, group)

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        a = self.args
        max_pos = a.max_position_embeddings
        if not a.is_moe and a.max_sequence_length is not None:
            max_pos = a.max_sequence_length  # 0 is a bad value (build_spec says so), not "unset"
        return build_spec(
            a,
            FAMILY,
            BIDIRECTIONAL,
            settings=SETTINGS,
            likelihood=MASK_COUNT_ELBO,
            logit_shift=0,
            confidence="raw",
            quota_base="masks",
            samplers=LLADA_SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            sampler_defaults={"d3llm": dict(D3LLM_DEFAULTS)},
            threshold_keeps_lowest=True,  # d3LLM's get_transfer_index_entropy
            eot_token_names=EOT_TOKENS,
            max_position_embeddings=max_pos,
        )
