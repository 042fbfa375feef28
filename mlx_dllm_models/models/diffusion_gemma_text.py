"""DiffusionGemma's text stack (config.json's `text_config`), as mlx-lm's gemma4_text is Gemma 4's:
the layers both towers of `diffusion_gemma.Model` run over one set of weights.

Reproduces transformers' `models/diffusion_gemma/modular_diffusion_gemma.py` (text part) on mlx-lm's
`gemma4_text` layers: `TextConfig` (transformers' DiffusionGemmaTextConfig, checked and resolved
into gemma4_text's arguments), the MoE layer with one output scalar per tower, self-conditioning,
the encoder's masks and the read-only view of its K/V that the decoder attends to, and
`DiffusionGemmaTextModel` with its two passes (`encode`, `decode`).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models import gemma4_text
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.cache import RotatingKVCache

from .. import vision
from . import cpu_layers
from .common import check_token_ids

NAME = "diffusion_gemma"


@dataclass
class TextConfig(BaseModelArgs):
    """`text_config` of config.json; defaults are transformers' DiffusionGemmaTextConfig ones."""

    vocab_size: int = 262144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    moe_intermediate_size: Optional[int] = None
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    # Full-attention layers' head size and K/V heads. Older configs name them directly;
    # transformers >= 5.x serialises them as `per_layer_config`. Without either, transformers uses
    # 512 and num_key_value_heads.
    global_head_dim: Optional[int] = None
    num_global_key_value_heads: Optional[int] = None
    per_layer_config: Optional[Dict[str, Any]] = None
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    sliding_window: int = 512
    layer_types: Optional[List[str]] = None
    rope_parameters: Optional[Dict[str, Dict[str, Any]]] = None
    # A class attribute in transformers (never serialised): 30.
    final_logit_softcapping: Optional[float] = 30.0
    attention_bias: bool = False
    use_bidirectional_attention: Optional[str] = None
    num_experts: Optional[int] = None
    top_k_experts: Optional[int] = None
    pad_token_id: Optional[int] = 0
    eos_token_id: Optional[Union[int, List[int]]] = 1
    bos_token_id: Optional[int] = 2
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (i + 1) % 6 else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"{NAME}: layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}; fix config.json's text_config."
            )
        # transformers forces the last layer to full attention.
        self.layer_types[-1] = "full_attention"
        if self.rope_parameters is None:
            self.rope_parameters = {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                },
            }
        sliding_rope = self.rope_parameters.get("sliding_attention", {})
        if sliding_rope.get("rope_type", "default") == "default" and (
            sliding_rope.get("partial_rotary_factor", 1.0) != 1.0
        ):
            raise ValueError(
                f"{NAME}: partial rotary on sliding layers is not supported "
                f"(rope_parameters.sliding_attention={sliding_rope})."
            )
        self._resolve_full_layer_shapes()
        if not self.num_experts or not self.top_k_experts or not self.moe_intermediate_size:
            raise ValueError(
                f"{NAME}: text_config needs num_experts, top_k_experts and moe_intermediate_size "
                "(every DiffusionGemma layer has routed experts)."
            )
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_approx"):
            raise ValueError(
                f"{NAME}: hidden_activation {self.hidden_activation!r} is not supported; "
                "Gemma-4 uses gelu_pytorch_tanh."
            )
        if self.attention_bias:
            raise ValueError(f"{NAME}: attention_bias=true is not supported.")
        if self.use_bidirectional_attention == "all":
            # transformers then makes the encoder bidirectional and halves the window.
            raise ValueError(
                f"{NAME}: use_bidirectional_attention='all' (bidirectional encoder) is not "
                "supported; the released checkpoints use 'vision'."
            )
        ids = ("pad_token_id", "eos_token_id", "bos_token_id")
        check_token_ids(
            NAME,
            self.vocab_size,
            {f"text_config.{k}": getattr(self, k) for k in ids},
            vocab_key="text_config.vocab_size",
        )

    def _resolve_full_layer_shapes(self):
        full = [i for i, t in enumerate(self.layer_types) if t == "full_attention"]
        overrides = {int(k): v for k, v in (self.per_layer_config or {}).items()}
        for i, v in overrides.items():
            if self.layer_types[i] != "full_attention" and v:
                raise ValueError(
                    f"{NAME}: per_layer_config overrides sliding layer {i} ({v}); only "
                    "full-attention layers may differ."
                )
        if overrides:
            head_dims = {overrides.get(i, {}).get("head_dim", self.head_dim) for i in full}
            kv_heads = {
                overrides.get(i, {}).get("num_key_value_heads", self.num_key_value_heads)
                for i in full
            }
            if len(head_dims) > 1 or len(kv_heads) > 1:
                raise ValueError(
                    f"{NAME}: full-attention layers disagree in per_layer_config "
                    f"(head_dim {sorted(head_dims)}, num_key_value_heads {sorted(kv_heads)})."
                )
            self.global_head_dim = head_dims.pop()
            self.num_global_key_value_heads = kv_heads.pop()
        if self.global_head_dim is None:
            self.global_head_dim = 512
        if self.num_global_key_value_heads is None:
            self.num_global_key_value_heads = self.num_key_value_heads

    def gemma4_args(self) -> gemma4_text.ModelArgs:
        """The same stack in mlx-lm gemma4_text's terms: MoE on, K=V on full layers, no PLE, no
        KV sharing, no double-wide MLP."""
        return gemma4_text.ModelArgs(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            global_head_dim=self.global_head_dim,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_key_value_heads=self.num_key_value_heads,
            num_global_key_value_heads=self.num_global_key_value_heads,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=0,
            rope_parameters=self.rope_parameters,
            sliding_window=self.sliding_window,
            max_position_embeddings=self.max_position_embeddings,
            attention_k_eq_v=True,
            final_logit_softcapping=self.final_logit_softcapping,
            use_double_wide_mlp=False,
            enable_moe_block=True,
            num_experts=self.num_experts,
            top_k_experts=self.top_k_experts,
            moe_intermediate_size=self.moe_intermediate_size,
            layer_types=self.layer_types,
        )


class Experts(gemma4_text.Experts):
    """gemma4_text's routed experts; once sharded (`sharding_group` set by Model.shard) each rank
    holds a slice of every expert's intermediate dimension and the weighted sum is reduced here,
    before the layer's post-expert norm."""

    def __init__(self, config: gemma4_text.ModelArgs):
        super().__init__(config)
        self.sharding_group = None

    def __call__(self, x, top_k_indices, top_k_weights):
        if self.sharding_group is None:
            return super().__call__(x, top_k_indices, top_k_weights)
        x = sum_gradients(self.sharding_group)(x)
        y = super().__call__(x, top_k_indices, top_k_weights)
        return mx.distributed.all_sum(y, group=self.sharding_group)


class DiffusionGemmaLayer(gemma4_text.DecoderLayer):
    """gemma4_text's MoE layer, with one output scalar per tower: the encoder and decoder share
    every other weight, but the checkpoint's `layer_scalar` differs between them."""

    def __init__(self, args: gemma4_text.ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        # None turns off the parent's single scalar; the tower picks its own below.
        self.layer_scalar = None
        self.experts = Experts(args)
        self.decoder_layer_scalar = mx.ones((1,))
        self.encoder_layer_scalar = mx.ones((1,))

    def __call__(self, x, mask=None, cache=None, encoder: bool = False):
        h, _, _ = super().__call__(x, mask, cache)
        return h * (self.encoder_layer_scalar if encoder else self.decoder_layer_scalar)


class SelfConditioning(gemma4_text.MLP):
    """transformers' DiffusionGemmaSelfConditioning:
    inputs = post_norm(embeds + MLP(pre_norm(soft))), a GeGLU MLP of the dense intermediate size
    and a weight-less post norm."""

    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__(args)
        self.pre_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_norm = gemma4_text.RMSNormNoScale(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, embeds, soft=None):
        # No previous logits means a zero signal, whose MLP output is exactly zero (no biases).
        if soft is not None:
            embeds = embeds + super().__call__(self.pre_norm(soft))
        return self.post_norm(embeds)


class PaddingMasks(dict):
    """Decoder keep-masks by layer type for a left-padded batch, with `pads` (B,): each row's
    left padding, which its RoPE positions leave out (RowPositions)."""

    def __init__(self, masks, pads: mx.array):
        super().__init__(masks)
        self.pads = pads


def left_padding(valid: mx.array) -> mx.array:
    """(B,) int32: each left-padded row's padding, from `valid` (B, positions; False at pads)."""
    return (~valid).sum(axis=1).astype(mx.int32)


class RowPositions:
    """A layer's cache (or None) as the attention reads it, with an `offset` of each row's own
    (B,): the positions so far less the row's left padding, so that a padded row's RoPE
    positions, and so its numbers, are those of its run alone (RoPE is relative in exact
    arithmetic, not in floating point). The K/V go through the wrapped cache."""

    def __init__(self, cache, pads: mx.array):
        self.cache, self.pads = cache, pads

    @property
    def offset(self):
        return (self.cache.offset if self.cache is not None else 0) - self.pads

    def update_and_fetch(self, keys, values):
        if self.cache is None:
            return keys, values
        return self.cache.update_and_fetch(keys, values)

    def __getattr__(self, name):
        if name in ("cache", "pads"):
            raise AttributeError(name)
        return getattr(self.cache, name)


class EncoderPrefix:
    """The encoder K/V of one layer as a decoder layer reads it: `update_and_fetch` returns
    [prefix ; canvas] and stores nothing, so the cache stays as the encoder left it."""

    def __init__(self, cache, window: Optional[int] = None):
        self.offset = getattr(cache, "offset", 0) if cache is not None else 0
        self.keys = self.values = None
        kv = _encoded_kv(cache)
        if kv is not None:
            keys, values = kv
            if window is not None and keys.shape[2] > window:
                keys, values = keys[..., -window:, :], values[..., -window:, :]
            self.keys, self.values = keys, values

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            return keys, values
        return (
            mx.concatenate([self.keys, keys], axis=2),
            mx.concatenate([self.values, values], axis=2),
        )


def _encoded_kv(cache):
    """Keys and values of everything `cache` holds, oldest first; None when empty."""
    if cache is None or getattr(cache, "keys", None) is None:
        return None
    if hasattr(cache, "decoder_state"):  # caches of this package may expose their own view
        return cache.decoder_state
    if isinstance(cache, RotatingKVCache):
        return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    offset = cache.offset
    return cache.keys[..., :offset, :], cache.values[..., :offset, :]


def _encoder_mask(n_new, cache, window, valid, blocks):
    """Keep-mask (B or 1, 1, n_new, keys) of an encoder pass over `n_new` new positions, for the
    keys that the layer's cache returns: every position for a KVCache, the last
    `max_size - 1` before the new ones (in temporal order) for a RotatingKVCache. Causal, within
    `window` on sliding layers; `valid` (B, all positions so far) drops padding keys (each query
    keeps itself, so that no softmax row is empty); `blocks` (B, n_new, n_new) lets image tokens of
    one run see each other."""
    before = cache.offset if cache is not None else 0
    kept = before
    if isinstance(cache, RotatingKVCache):
        if n_new == 1 and before > 0:
            # mlx-lm writes a single token in place (keys come back rotated): only a mask-free
            # pass is possible, which holds while no padding is in view.
            start = max(0, before + 1 - cache.max_size)
            if blocks is None and (valid is None or bool(valid[:, start:].all().item())):
                return None
            raise ValueError(
                f"{NAME}: a single new position cannot be encoded into a windowed cache while "
                "padding is in view; encode at least two positions at a time"
            )
        kept = min(before, cache.max_size - 1)
    q = mx.arange(before, before + n_new)[:, None]
    k = mx.arange(before - kept, before + n_new)[None, :]
    keep = k <= q
    if window is not None:
        keep = keep & (q - k < window)
    keep = keep[None, None]
    if blocks is not None:
        side = mx.zeros((blocks.shape[0], n_new, kept), dtype=mx.bool_)
        keep = keep | mx.concatenate([side, blocks], axis=-1)[:, None]
    if valid is not None:
        keys_valid = valid[:, before - kept : before + n_new]
        keep = (keep & keys_valid[:, None, None, :]) | (k == q)[None, None]
    return keep


class DiffusionGemmaTextModel(nn.Module):
    def __init__(self, args: TextConfig):
        super().__init__()
        g = args.gemma4_args()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_scale = args.hidden_size**0.5
        self.layers = [DiffusionGemmaLayer(g, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_conditioning = SelfConditioning(g)
        self.sliding_window = args.sliding_window
        self.bidirectional_vision = args.use_bidirectional_attention == "vision"

    def _embed(self, ids):
        return self.embed_tokens(ids) * self.embed_scale

    def soft_embeddings(self, logits):
        """softmax(logits) @ E * sqrt(hidden), the softmax in float32 as in transformers."""
        e = self.embed_tokens
        if isinstance(e, cpu_layers.TABLES) and cpu_layers.on_cpu():
            p = mx.softmax(logits.astype(mx.float32), axis=-1)
            return cpu_layers.rows_times(e, p) * self.embed_scale
        if isinstance(e, nn.QuantizedEmbedding):
            p = mx.softmax(logits.astype(mx.float32), axis=-1).astype(e.scales.dtype)
            # The table is [V, H] quantized along H: p @ E is the untransposed product.
            soft = mx.quantized_matmul(
                p,
                e.weight,
                e.scales,
                getattr(e, "biases", None),
                transpose=False,
                group_size=e.group_size,
                bits=e.bits,
                mode=e.mode,
            )
        else:
            p = mx.softmax(logits.astype(mx.float32), axis=-1).astype(e.weight.dtype)
            soft = p @ e.weight
        return soft * self.embed_scale

    def encode(self, inputs, cache=None, valid=None, features=None, image_token_id=None):
        h = self._embed(inputs)
        blocks = None
        if features is not None:
            h = vision.place_features(h, inputs, features, image_token_id)
            if self.bidirectional_vision:
                blocks = vision.vision_blocks(inputs, image_token_id)
        cache = cache or [None] * len(self.layers)
        masks = {}
        for layer, c in zip(self.layers, cache):
            if layer.layer_type not in masks:
                window = self.sliding_window if layer.self_attn.is_sliding else None
                if valid is None and blocks is None:
                    masks[layer.layer_type] = create_attention_mask(h, c, window_size=window)
                else:
                    masks[layer.layer_type] = _encoder_mask(
                        inputs.shape[1], c, window, valid, blocks
                    )
        pads = None if valid is None else left_padding(valid)
        for layer, c in zip(self.layers, cache):
            c = c if pads is None else RowPositions(c, pads)
            h = layer(h, masks[layer.layer_type], c, encoder=True)
        return self.norm(h)

    def decode(self, canvas, cache=None, self_cond_logits=None, mask=None):
        soft = None if self_cond_logits is None else self.soft_embeddings(self_cond_logits)
        h = self.self_conditioning(self._embed(canvas), soft)
        cache = cache or [None] * len(self.layers)
        # transformers' sliding cache layer keeps sliding_window - 1 tokens for the next query.
        window = self.sliding_window - 1
        pads = getattr(mask, "pads", None)  # a padded batch's rows: their own positions
        for layer, c in zip(self.layers, cache):
            prefix = EncoderPrefix(c, window if layer.self_attn.is_sliding else None)
            if pads is not None:
                prefix.offset = prefix.offset - pads
            m = mask.get(layer.layer_type) if isinstance(mask, dict) else mask
            h = layer(h, m, prefix, encoder=False)
        return self.norm(h)
