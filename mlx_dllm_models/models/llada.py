"""LLaDA 8B (`LLaDAModelLM`, model_type "llada"): a Llama body under OLMo names
(`model.transformer.blocks.N.*`), read bidirectionally: `mask=None` means every query sees every
key, and logits at position i predict token i (no shift).

LLaDA-MoE-7B-A1B (`LLaDAMoEModelLM`) writes model_type "llada" too; its body is models/llada_moe.py.
The config's `architectures` (or the presence of `num_experts`) picks the body: `ModelArgs.from_dict`
and `Model` build LLaDA-MoE's for an MoE config (`MoEModel`: its body with this family's spec), so
that mlx-lm, which takes this module's `ModelArgs` and `Model` for model_type "llada", loads both.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from ..settings_families import D3LLM_DEFAULTS
from ..spec import BIDIRECTIONAL, MASK_COUNT_ELBO, SHARED_SAMPLERS, DiffusionSpec
from . import llada_moe, lumina_dimoo, sharding
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
# LLaDA's OLMo config names -> the Llama names of the same sizes (LLaDA-V's config.json).
LLAMA_NAMES = {
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "mlp_hidden_size": "intermediate_size",
    "max_sequence_length": "max_position_embeddings",
    "include_qkv_bias": "attention_bias",
}

LLADA_SAMPLERS = SHARED_SAMPLERS + ("random", "d3llm")
# The end-of-turn token that confidence_eos_eot_inf scores 0 (generate.py hard-codes 126348, LLaDA
# 8B's <|eot_id|>), by name, resolved through the checkpoint's tokenizer; LLaDA-MoE's chat template
# ends a turn with <|role_end|>.
EOT_TOKENS = ("<|eot_id|>", "<|role_end|>")


@dataclass
class ModelArgs(llada_moe.SharedArgs):
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

    # LLaDA-MoE's args (llada_moe.ModelArgs) say True.
    is_moe = False

    @classmethod
    def from_dict(cls, params):
        """LLaDA 8B's args, or LLaDA-MoE's for an MoE config (both say model_type "llada")."""
        if cls is ModelArgs and llada_moe.is_moe_config(params):
            return llada_moe.ModelArgs.from_dict(params)
        return super().from_dict(params)

    def __post_init__(self):
        if self.mask_token_id is None:
            raise ValueError(
                f"{self.model_type}: checkpoint has no mask_token_id; add it to config.json "
                "(126336, <|mdm_mask|>, for LLaDA-8B; 156895, <|mask|>, for LLaDA-MoE)"
            )
        llada_moe.require(self, ("d_model", "n_layers", "n_heads", "vocab_size"), "LLaDAModelLM")
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
        check_special_ids(self)
        for key in ("max_sequence_length", "max_position_embeddings"):
            check_context_length(self.model_type, key, getattr(self, key))

    @property
    def rows_of_vocab(self) -> int:
        # OLMo sizes wte and the head by embedding_size (padded vocabulary) when it is set.
        return self.embedding_size or self.vocab_size

    def llama_args(self) -> llama.ModelArgs:
        """The same attention geometry in mlx-lm's Llama terms, to build its layers."""
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


class LLaDABody(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.rows_of_vocab, args.d_model)
        self.layers = [_dense_block(args) for _ in range(args.n_layers)]
        self.norm = nn.RMSNorm(args.d_model, eps=args.rms_norm_eps)


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


class LLaDASpec:
    """What LLaDA 8B's and LLaDA-MoE's models share: the family's spec, and mlx-lm's AR tools
    refused."""

    # mlx-lm's AR tools call make_cache first: they stop there with a pointer to mlx_dllm.
    make_cache = refuse_autoregressive_tools

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        a = self.args
        max_pos = a.max_position_embeddings
        if not a.is_moe and a.max_sequence_length is not None:
            max_pos = a.max_sequence_length  # 0 is a bad value (build_spec says so), not "unset"
        return llada_spec(a, defaults=dict(REFERENCE_DEFAULTS), max_position_embeddings=max_pos)


def llada_spec(args, **fields) -> DiffusionSpec:
    """The spec of LLaDA generate.py's families (LLaDA 8B, LLaDA-MoE, LLaDA-V): what they share,
    with `fields` (their defaults, ...) added."""
    return build_spec(
        args,
        FAMILY,
        BIDIRECTIONAL,
        settings=SETTINGS,
        likelihood=MASK_COUNT_ELBO,
        logit_shift=0,
        confidence="raw",
        quota_base="masks",
        samplers=LLADA_SAMPLERS,
        sampler_defaults={"d3llm": dict(D3LLM_DEFAULTS)},
        threshold_keeps_lowest=True,  # d3LLM's get_transfer_index_entropy
        eot_token_names=EOT_TOKENS,
        **fields,
    )


class Model(LLaDASpec, nn.Module):
    """LLaDAModelLM; built from LLaDA-MoE's args, it is a MoEModel instead (the model_type is
    theirs too)."""

    def __new__(cls, args):
        if cls is Model and args.is_moe:
            return MoEModel(args)
        return super().__new__(cls)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LLaDABody(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.d_model, args.rows_of_vocab, bias=args.include_bias)

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        logits = masked_forward(self, self.model.embed_tokens, inputs, cache, mask, head_span)
        if self.args.scale_logits:
            logits = logits * (self.args.d_model**-0.5)
        return logits

    @property
    def layers(self):
        return self.model.layers

    @property
    def image_spec(self):
        """Lumina-DiMOO's image facts when config.json names its class (models/lumina_dimoo.py);
        None for LLaDA 8B, which writes no image tokens."""
        return lumina_dimoo.image_spec(self.args)

    def sanitize(self, weights):
        origin = {_rename_olmo(k): k for k in weights}
        weights = {_rename_olmo(k): v for k, v in weights.items() if not k.endswith("inv_freq")}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        layout = "LLaDAModelLM's OLMo layout (e.g. 'model.transformer.blocks.0.ff_proj.weight')"
        keys = (
            "n_layers, d_model, n_heads, n_kv_heads, mlp_hidden_size, include_bias, "
            "include_qkv_bias, weight_tying, vocab_size / embedding_size"
        )
        return check_weights(self, weights, "llada", layout, keys, origin)

    def to_hf_weights(self, weights):
        """This module's names -> the checkpoint's, the inverse of `sanitize`, to save a trained
        model in its family's layout: LLaDA 8B's OLMo names."""
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

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism over `group` as mlx-lm's llama.Model.shard, after a readable check
        that the group divides the heads and the MLP."""
        group = sharding.group_of(group)
        a = self.args
        sizes = {"n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads}
        sharding.check_divisible(
            "llada", group, dict(sizes, mlp_hidden_size=a.mlp_hidden_size), model=self
        )
        return llama.Model.shard(self, group)


class MoEModel(LLaDASpec, llada_moe.Model):
    """LLaDA-MoE's body (models/llada_moe.py) with this family's spec."""
