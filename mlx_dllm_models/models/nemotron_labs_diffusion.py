"""Nemotron-Labs-Diffusion (NVIDIA): a Ministral-3 body that runs causally (AR) or bidirectionally.

Reproduces the HF remote code `modeling_nemotron_labs_diffusion.py`: the Ministral-3 decoder under
`encoder.*`, YaRN RoPE, the Llama-4 query scaling after RoPE, and an untied `diffusion_head`. Logits
are not shifted: logits[i] predict position i. The same weights serve both attention modes; the
caller chooses one per forward:

* `mask=None` attends to every key, i.e. bidirectionally over [cache ; inputs] (a plain `model(ids)`
  is the reference's bidirectional full-sequence forward), and `mask="causal"` is the AR forward.
* mlx-lm's own generation (`mlx_lm.generate`, batch generation, quantized or saved prompt caches)
  calls `model(inputs, cache=cache)` with caches of mlx-lm's classes and never passes a mask. So a
  cache whose class comes from `mlx_lm.models.cache`, with no mask given, means "AR use": the
  forward is causal. Caches of any other origin (this package's diffusion caches) keep the
  protocol's bidirectional default; an explicit mask always wins.
"""

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import ministral3
from mlx_lm.models.base import create_attention_mask

from ..spec import CAUSAL_PREFIX, DiffusionSpec
from .common import (
    build_spec,
    cached_spec,
    check_special_ids,
    check_weights,
    drop_tied_head,
    drop_unused_buffers,
    project,
    run_layers,
)


@dataclass
class ModelArgs(ministral3.ModelArgs):
    max_position_embeddings: Optional[int] = 262144
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict] = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    mask_token_id: Optional[int] = None
    bos_token_id: Optional[int] = 1
    eos_token_id: Any = 2
    pad_token_id: Optional[int] = None
    block_size: int = 32

    def __post_init__(self):
        super().__post_init__()
        # No mask id (null or -1) leaves an AR-only checkpoint; diffusion_spec says so when asked.
        check_special_ids(self, mask_absent=(None, -1))
        if self.attention_bias or self.mlp_bias or self.hidden_act != "silu":
            raise ValueError(
                "nemotron_labs_diffusion: only bias-free SiLU checkpoints are supported "
                f"(attention_bias={self.attention_bias}, mlp_bias={self.mlp_bias}, "
                f"hidden_act={self.hidden_act!r})."
            )
        if any(t != "full_attention" for t in self.layer_types):
            raise ValueError(
                "nemotron_labs_diffusion: sliding-window layers are not supported "
                f"(layer_types={self.layer_types})."
            )
        # Older configs carry `rope_scaling` and a top-level `rope_theta`; ministral3's layers read
        # everything from `rope_parameters`. Without a Llama-4 beta the query scale is 1.
        rope = dict(self.rope_parameters or self.rope_scaling or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.setdefault("rope_theta", self.rope_theta)
        rope.setdefault("llama_4_scaling_beta", 0.0)
        # HF's YaRN falls back to max_position_embeddings; mlx-lm's YarnRoPE would use 4096.
        rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        self.rope_parameters = rope


def query_scale(length: int, offset, beta: float, original_max: int) -> mx.array:
    """Llama-4 query scale `1 + beta * log(1 + floor(pos / original_max))`, shaped to multiply
    (B or 1, heads, length, head_dim) queries; `offset` is an int or a (B,) array.

    ministral3's helper, except that negative positions (left padding, where a row's first real
    token is position 0) get scale 1: log(1 + floor(neg / M)) is -inf or NaN there, and NaN in pad
    rows reaches real rows through 0 * NaN in the next layer's attention.
    """
    if isinstance(offset, mx.array) and offset.ndim > 0:
        offset = offset[:, None]
    pos = mx.maximum(mx.arange(length) + offset, 0)
    scale = 1 + beta * mx.log(1 + mx.floor(pos / original_max))
    return scale[:, None, :, None] if scale.ndim == 2 else scale[:, None]


_NAME = "nemotron_labs_diffusion"


def _is_mlx_lm_cache(c) -> bool:
    return type(c).__module__ == "mlx_lm.models.cache"


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [ministral3.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.encoder = Encoder(args)
        if not args.tie_word_embeddings:
            self.diffusion_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        h = self.encoder.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        offset = 0 if cache[0] is None else cache[0].offset
        if mask is None and _is_mlx_lm_cache(cache[0]):
            mask = "causal"
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
            # mlx-lm's helper: None for one row, and the batch caches' left-padding masks.
            mask = create_attention_mask(h, cache[0])

        rope = self.args.rope_parameters
        q_scale = query_scale(
            inputs.shape[1],
            offset,
            rope["llama_4_scaling_beta"],
            rope["original_max_position_embeddings"],
        ).astype(h.dtype)
        h = run_layers(self.layers, h, cache, mask, q_scale)
        head = None if self.args.tie_word_embeddings else self.diffusion_head
        return project(h, head_span, self.encoder.norm, self.encoder.embed_tokens, head)

    def sanitize(self, weights):
        weights = {
            k: v
            for k, v in drop_unused_buffers(weights).items()
            if not k.endswith((".self_attn.k_scale", ".self_attn.v_scale"))
        }
        drop_tied_head(weights, _NAME, self.args.tie_word_embeddings, "diffusion_head.weight")
        # FP8 checkpoints: ministral3 folds weight_scale_inv into the weights.
        weights = ministral3.Model.sanitize(self, weights)
        layout = "the HF layout encoder.* and diffusion_head.weight"
        keys = "num_hidden_layers, vocab_size, hidden_size, intermediate_size, head_dim, heads"
        return check_weights(self, weights, _NAME, layout, keys)

    @property
    def layers(self):
        return self.encoder.layers

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        a = self.args
        return build_spec(
            a,
            "nemotron",
            CAUSAL_PREFIX,
            "set mask_token_id (100 in NVIDIA's checkpoints; -1 counts as none), or use the "
            "checkpoint as an AR model with mlx_lm.generate.",
            confidence="raw",
            quota_base="masks",
            # The HF reference denoises one token per step over a block of block_size.
            defaults={
                "block_length": a.block_size,
                "sampler": "quota",
                "threshold": 0.9,
                "temperature": 0.0,
                "max_tokens": 128,
                "mode": "diffusion",
            },
            trained_block_length=a.block_size,
        )
