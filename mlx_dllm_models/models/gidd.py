"""GIDD (dvruette/gidd-unif-3b, gidd-mask-3b, gidd-unif-10b): the scaled-up Generalized Interpolating
Discrete Diffusion models of "Scaling Behavior of Discrete Diffusion Language Models", uniform or
masked noise, over a 131072-token BPE vocabulary.

Reproduces the checkpoints' remote `modeling_gidd.py` (GitHub dvruette/gidd-easydel,
gidd_easydel/model/modeling_gidd_hf.py; config: configuration_gidd.py): a pre-norm transformer
whose RMSNorms scale by (1 + weight), with a query / key RMSNorm over the whole projection, a
learned key / value pair every query attends to (`k_bias` / `v_bias`, `attention_bias`), attention
scores soft-capped (`attn_soft_cap` * tanh(s / cap)), a ReLU² MLP with biases (`mlp_bias`),
residual branches scaled by resid_scale / num_hidden_layers, projections scaled by
`weight_scaling` and the head by `head_scaling`. Logits at position i predict token i.

Its forward takes a (B, L_q, L_k) boolean mask, all-true when none is given (bidirectional);
`generate` passes noise_mask[i] >= noise_mask[j]: clean positions (prompt, finished blocks) see
only clean ones, noisy positions see everything. The decoder (engine/gidd.py) runs that as the
clean prefix's forward, whose K/V every later forward of the block reads (`prefix_cache`), and
forwards over the rest of the canvas with no mask.

Decoding: `generate`'s block-wise denoising over a canvas that spans the context
(max_position_embeddings), started from the noise prior (decoding/gidd.py).
"""

from dataclasses import dataclass
from typing import List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs

from ..engine.gidd import GiddDecoder
from ..errors import SettingsError
from ..settings_families import Setting
from ..spec import CLEAN_PREFIX, DiffusionSpec
from ..validators import choice, int_at_least
from . import sharding
from .common import (
    cached_spec,
    check_special_ids,
    check_weights,
    own_loop_spec,
    refuse_autoregressive_tools,
)

# The loop this family registers (its spec's `decoder` names it): block-wise ancestral / adaptive
# denoising over the context-long canvas.
DECODERS = {"gidd": GiddDecoder}

FAMILY = "gidd"

# generate()'s special-token defaults (bos 0, eos 1, pad 2, mask 3), the ids of the checkpoints'
# tokenizer (dvruette/nemotron-cc-bpe); config.json carries bos / eos but no mask id.
GIDD_MASK_TOKEN_ID = 3
GIDD_PAD_TOKEN_ID = 2

SAMPLER_NAMES = ("ancestral", "adaptive")
NOISE_SCHEDULES = ("cosine", "linear")

# GiddForDiffusionLM.generate's own defaults (block_length=128, steps=128, temperature=1.0,
# sampling_method="ancestral", noise_schedule="cosine", tokens_per_step=1); max_tokens is the
# README call's max_length=128 (generate's 2048 is the context).
REFERENCE_DEFAULTS = {
    "block_length": 128,
    "steps": 128,
    "temperature": 1.0,
    "sampler": "ancestral",
    "noise_schedule": "cosine",
    "tokens_per_step": 1,
    "max_tokens": 128,
}

SETTINGS = (
    Setting(
        "noise_schedule",
        None,
        "GIDD: the noise schedule of a block's steps (alpha from 1 - t or cos)",
        str,
        choice(NOISE_SCHEDULES, " (GIDD)"),
    ),
    Setting(
        "tokens_per_step",
        None,
        "GIDD: positions the adaptive sampler changes per step",
        int,
        int_at_least(1),
        samplers=("adaptive",),
    ),
)
_OWN_SAMPLERS = "its samplers are 'ancestral' (the posterior draw) and 'adaptive'"
UNUSED_SETTINGS = {"factor": _OWN_SAMPLERS, "entropy_bound": _OWN_SAMPLERS}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int = 131072
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    head_dim: Optional[int] = None
    attn_soft_cap: Optional[float] = 30.0
    max_position_embeddings: int = 1024
    resid_scale: float = 4.0
    rms_norm_eps: float = 1e-6
    use_qk_norm: bool = True
    weight_scaling: Union[str, float] = "fan_in"
    head_scaling: float = 1.0
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # The noise: the prior's and the schedule's mixing of uniform ids and masks is
    # sigmoid(log_snr + noise_type) uniform (1000: uniform noise, -1000: masks).
    noise_type: float = 0.0
    min_log_snr: float = -9.0
    max_log_snr: float = 9.0
    bos_token_id: Optional[int] = 0
    eos_token_id: Union[int, List[int], None] = 1
    pad_token_id: Optional[int] = None
    mask_token_id: Optional[int] = None

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.pad_token_id is None:
            self.pad_token_id = GIDD_PAD_TOKEN_ID
        check_special_ids(self, mask_default=GIDD_MASK_TOKEN_ID)


def output_scale(value, dims_in: int, dims_out: int) -> float:
    """ScaledLinear's output scale: "fan_in" / "fan_out" or a number."""
    if value == "fan_in":
        return dims_in**-0.5
    if value == "fan_out":
        return dims_out**-0.5
    return float(value)


def scaled(layer, x, scale: float):
    """ScaledLinear's forward, (x W^T) * scale + bias, over a plain (or quantized) linear layer:
    the scale is kept by the layer's parent, so that mlx-lm's quantization, which replaces the
    layer, keeps it."""
    y = layer(x)
    if scale == 1.0:
        return y
    # The layer added its bias before the scale: s (xW + b) + (1 - s) b = s xW + b.
    return scale * y + (1 - scale) * layer.bias if "bias" in layer else scale * y


class GiddRMSNorm(nn.Module):
    """RMSNorm in float32 scaling by (1 + weight), cast back to the input's dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x):
        h = x.astype(mx.float32)
        h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return ((1 + self.weight.astype(mx.float32)) * h).astype(x.dtype)


class PrefixKV:
    """A layer's K/V of the clean prefix: written by the prefix's forward, read (never extended)
    by every forward over the noisy rest of the canvas, whose positions follow it."""

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values, self.offset = keys, values, keys.shape[2]
            return keys, values
        return (
            mx.concatenate([self.keys, keys], axis=2),
            mx.concatenate([self.values, values], axis=2),
        )

    def select(self, idx: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.hidden_size // args.head_dim
        self.head_dim = args.head_dim
        width = self.n_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, args.hidden_size, bias=False)
        self.in_scale = output_scale(args.weight_scaling, args.hidden_size, width)
        self.out_scale = output_scale(args.weight_scaling, width, args.hidden_size)
        if args.use_qk_norm:
            self.q_norm = GiddRMSNorm(args.hidden_size, args.rms_norm_eps)
            self.k_norm = GiddRMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.attention_bias:
            self.k_bias = mx.zeros((self.n_heads, self.head_dim))
            self.v_bias = mx.zeros((self.n_heads, self.head_dim))
        self.soft_cap = args.attn_soft_cap
        self.rope = nn.RoPE(args.hidden_size // args.num_attention_heads, base=args.rope_theta)

    def _heads(self, x, B, L):
        return x.reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x, mask=None, cache: Optional[PrefixKV] = None):
        B, L, _ = x.shape
        q, k, v = (scaled(p, x, self.in_scale) for p in (self.q_proj, self.k_proj, self.v_proj))
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self._heads(q, B, L), self._heads(k, B, L), self._heads(v, B, L)
        offset = 0 if cache is None else cache.offset
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.fetch(k, v)
        if "k_bias" in self:
            # The learned pair sits before every key and is always in view.
            shape = (B, self.n_heads, 1, self.head_dim)
            k = mx.concatenate([mx.broadcast_to(self.k_bias[:, None], shape).astype(k.dtype), k], 2)
            v = mx.concatenate([mx.broadcast_to(self.v_bias[:, None], shape).astype(v.dtype), v], 2)
            if mask is not None:
                mask = mx.broadcast_to(mask, mask.shape[:-1] + (k.shape[2] - 1,))
                sink = mx.ones(mask.shape[:-1] + (1,), dtype=mx.bool_)
                mask = mx.concatenate([sink, mask], axis=-1)
        scores = (q * self.head_dim**-0.5) @ k.transpose(0, 1, 3, 2)
        if self.soft_cap:
            scores = self.soft_cap * mx.tanh(scores / self.soft_cap)
        if mask is not None:
            if mask.ndim == 3:
                mask = mask[:, None]
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(scores.dtype)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return scaled(self.o_proj, out, self.out_scale)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i, scale = args.hidden_size, args.intermediate_size, args.weight_scaling
        self.up_proj = nn.Linear(h, i, bias=args.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=args.mlp_bias)
        self.up_scale, self.down_scale = output_scale(scale, h, i), output_scale(scale, i, h)

    def __call__(self, x):
        h = mx.square(nn.relu(scaled(self.up_proj, x, self.up_scale)))
        return scaled(self.down_proj, h, self.down_scale)


class GiddLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.attn_layernorm = GiddRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp_layernorm = GiddRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.resid_scale = args.resid_scale / args.num_hidden_layers

    def __call__(self, h, mask=None, cache=None):
        h = h + self.resid_scale * self.self_attn(self.attn_layernorm(h), mask, cache)
        return h + self.resid_scale * self.mlp(self.mlp_layernorm(h))


class GiddModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [GiddLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = GiddRMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(nn.Module):
    """GiddForDiffusionLM."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GiddModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        """Logits of `inputs` under `mask` (a boolean (B, L, L_k) or (L, L_k) array, True where a
        query sees a key; None: every key, GIDD's own default), after the clean prefix's K/V in
        `cache` (prefix_cache()) when given. `head_span`: the positions the head runs over."""
        if isinstance(mask, str):
            raise ValueError(f"gidd: its forward takes a boolean mask or none, not {mask!r}")
        h = self.model.embed_tokens(inputs)
        caches = cache if cache is not None else [None] * len(self.layers)
        for layer, c in zip(self.layers, caches):
            h = layer(h, mask, c)
        if head_span is not None:
            h = h[:, head_span] if isinstance(head_span, slice) else h[:, slice(*head_span)]
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return scaled(self.lm_head, h, float(self.args.head_scaling))

    @property
    def layers(self):
        return self.model.layers

    def prefix_cache(self) -> List[PrefixKV]:
        return [PrefixKV() for _ in self.layers]

    make_cache = refuse_autoregressive_tools

    def sanitize(self, weights):
        # `model.frequencies` (RoPE's table) is a non-persistent buffer; some exports carry it.
        weights = {k: v for k, v in weights.items() if not k.endswith("frequencies")}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        layout = "GiddForDiffusionLM's layout (e.g. 'model.layers.0.self_attn.k_bias')"
        keys = (
            "num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, head_dim, "
            "vocab_size, use_qk_norm, attention_bias, mlp_bias, tie_word_embeddings"
        )
        return check_weights(self, weights, FAMILY, layout, keys)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """One rank only: the query / key RMSNorm normalizes over every head at once, so a rank
        holding some heads cannot normalize its slice alone."""
        n = sharding.group_of(group).size()
        if n > 1:
            raise SettingsError(
                f"{FAMILY}: cannot split the checkpoint over {n} ranks: its query / key RMSNorm "
                "normalizes over every attention head at once; run it on one rank"
            )

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        a = self.args
        return own_loop_spec(
            a,
            FAMILY,
            CLEAN_PREFIX,
            DECODERS,
            SETTINGS,
            UNUSED_SETTINGS,
            REFERENCE_DEFAULTS,
            confidence="sampled",
            samplers=SAMPLER_NAMES,
            noise_log_snr=(float(a.min_log_snr), float(a.max_log_snr), float(a.noise_type)),
            # Its tokenizer ends an encoding with the EOS; the README's call cuts it off (an EOS in
            # the canvas would also end generate after its first block).
            prompt_drops_eos=True,
        )
