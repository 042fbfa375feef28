"""DiffusionGemma (google/diffusiongemma-*, `DiffusionGemmaForBlockDiffusion`): uniform-noise block
diffusion on a Gemma-4 MoE text stack.

Reproduces transformers' `models/diffusion_gemma/modular_diffusion_gemma.py` (text part). The
layers are mlx-lm's `gemma4_text` ones (sliding and full attention, proportional RoPE on full
layers, K=V on full layers, scale-less V norm, attention scale 1.0, dense GeGLU MLP beside the
routed experts, the router reading the un-normed residual, per-layer output scalar), run in two
modes over one set of weights:

* `encode(inputs, cache)`: the causal encoder (sliding window on sliding layers). It writes K/V
  into `cache` (from `make_cache()`: mlx-lm `KVCache` on full layers,
  `RotatingKVCache(sliding_window)` on sliding layers); positions continue across calls, so a
  prompt may be encoded in chunks and each finished canvas appended later.
* `decode(canvas, cache, self_cond_logits)`: the denoiser. Bidirectional over the canvas, reading
  the encoder K/V without writing it: full layers see every encoded position, sliding layers the
  last `sliding_window - 1` (what transformers' `DynamicSlidingWindowLayer` retains). Canvas
  positions continue after the encoded ones. Returns float32 softcapped logits; logits[i] predict
  canvas[i].

The two towers share every weight except the per-layer output scalar, of which the checkpoint keeps
one copy per tower. Self-conditioning (the previous step's logits fed back) is decoder-only.

Images: a checkpoint whose config.json has a `vision_config` gets mlx-vlm's Gemma 4 vision tower
and `embed_vision` projector (built in mlx_dllm_models.vision); `encode(..., pixel_values=...)`
puts the image features where the prompt holds the image token and, as transformers does for
`use_bidirectional_attention="vision"`, lets each run of image tokens attend to itself both ways.
Without a `vision_config` the vision weights are dropped and `Model.vision_tower` is None.

Decoding: the engine's canvas loop (mlx_dllm_models.engine.canvas, `DiffusionSpec.decoder` =
"canvas").
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models import gemma4_text
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .. import vision
from ..spec import ENCODER_CANVAS, DiffusionSpec, read_generation_config
from . import sharding
from .common import cached_spec, check_token_ids, check_weights, eos_token_ids, select_span

_NAME = "diffusion_gemma"

# Reference defaults: transformers' DiffusionGemmaGenerationConfig._get_default_generation_params
# and the official generation_config.json; the checkpoint's generation_config overrides them.
FAMILY_DEFAULTS = {
    "sampler": "entropy",
    "max_tokens": 256,
    "max_denoising_steps": 48,
    "entropy_bound": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}

# Every canvas, the last one included, is the trained canvas_length, and the output is cut at
# max_tokens afterwards, as transformers' generate does (ceil(max_new_tokens / canvas_length)
# canvases of config.canvas_length each): a shorter canvas is a length the denoiser was never
# trained on. min_canvas_length below canvas_length opts into shorter last canvases.

# generation_config.json key (dotted for nested ones) -> setting.
GENERATION_CONFIG_KEYS = {
    "max_new_tokens": "max_tokens",
    "max_denoising_steps": "max_denoising_steps",
    "sampler_config.entropy_bound": "entropy_bound",
    "t_min": "t_min",
    "t_max": "t_max",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}

# Shared generation_config keys that DiffusionGemma's decoder does not read (its temperature follows
# a schedule, its sampler draws from the whole distribution, each canvas is a block).
UNREAD_GENERATION_CONFIG_KEYS = ("block_length", "temperature", "top_p", "top_k")

# Kept at 8 bits when the rest is quantized lower: the always-active, precision-sensitive parts.
_EIGHT_BIT = {"group_size": 64, "bits": 8, "mode": "affine"}


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
                f"{_NAME}: layer_types has {len(self.layer_types)} entries for "
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
                f"{_NAME}: partial rotary on sliding layers is not supported "
                f"(rope_parameters.sliding_attention={sliding_rope})."
            )
        self._resolve_full_layer_shapes()
        if not self.num_experts or not self.top_k_experts or not self.moe_intermediate_size:
            raise ValueError(
                f"{_NAME}: text_config needs num_experts, top_k_experts and moe_intermediate_size "
                "(every DiffusionGemma layer has routed experts)."
            )
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_approx"):
            raise ValueError(
                f"{_NAME}: hidden_activation {self.hidden_activation!r} is not supported; "
                "Gemma-4 uses gelu_pytorch_tanh."
            )
        if self.attention_bias:
            raise ValueError(f"{_NAME}: attention_bias=true is not supported.")
        if self.use_bidirectional_attention == "all":
            # transformers then makes the encoder bidirectional and halves the window.
            raise ValueError(
                f"{_NAME}: use_bidirectional_attention='all' (bidirectional encoder) is not "
                "supported; the released checkpoints use 'vision'."
            )
        ids = ("pad_token_id", "eos_token_id", "bos_token_id")
        check_token_ids(
            _NAME,
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
                    f"{_NAME}: per_layer_config overrides sliding layer {i} ({v}); only "
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
                    f"{_NAME}: full-attention layers disagree in per_layer_config "
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


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = _NAME
    text_config: Union[TextConfig, Dict[str, Any]] = field(default_factory=dict)
    vision_config: Optional[Dict[str, Any]] = None
    canvas_length: int = 256
    tie_word_embeddings: bool = True
    boi_token_id: Optional[int] = None
    eoi_token_id: Optional[int] = None
    image_token_id: Optional[int] = None
    # mlx-lm's load_config copies generation_config.json's eos_token_id here.
    eos_token_id: Optional[Union[int, List[int]]] = None
    # The generation_config.json contents, where a loader passes them (mlx-vlm's config does).
    generation_config: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        if isinstance(self.text_config, dict):
            self.text_config = TextConfig.from_dict(self.text_config)
        if not (self.tie_word_embeddings and self.text_config.tie_word_embeddings):
            raise ValueError(
                f"{_NAME}: tie_word_embeddings=false (separate encoder, decoder and head weights) "
                "is not supported; the released checkpoints tie them."
            )
        # The image ids index the embedding table when a prompt holds an image.
        ids = ("image_token_id", "boi_token_id", "eoi_token_id", "eos_token_id")
        check_token_ids(
            _NAME,
            self.text_config.vocab_size,
            {k: getattr(self, k) for k in ids},
            vocab_key="text_config.vocab_size",
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
                f"{_NAME}: a single new position cannot be encoded into a windowed cache while "
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
        for layer, c in zip(self.layers, cache):
            h = layer(h, masks[layer.layer_type], c, encoder=True)
        return self.norm(h)

    def decode(self, canvas, cache=None, self_cond_logits=None, mask=None):
        soft = None if self_cond_logits is None else self.soft_embeddings(self_cond_logits)
        h = self.self_conditioning(self._embed(canvas), soft)
        cache = cache or [None] * len(self.layers)
        # transformers' sliding cache layer keeps sliding_window - 1 tokens for the next query.
        window = self.sliding_window - 1
        for layer, c in zip(self.layers, cache):
            prefix = EncoderPrefix(c, window if layer.self_attn.is_sliding else None)
            m = mask.get(layer.layer_type) if isinstance(mask, dict) else mask
            h = layer(h, m, prefix, encoder=False)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DiffusionGemmaTextModel(args.text_config)
        self.final_logit_softcapping = args.text_config.final_logit_softcapping
        if args.vision_config is not None:
            # Inside `model` so that mlx-lm's save keeps vision_config ("vision_tower" in
            # model.model) when converting.
            tower, embed = vision.build_vision(args.vision_config, args.text_config.hidden_size)
            self.model.vision_tower = tower
            self.model.embed_vision = embed

    @property
    def vision_tower(self):
        """mlx-vlm's Gemma 4 vision tower, or None for a text-only checkpoint."""
        return self.model.get("vision_tower")

    # -- the two modes -------------------------------------------------------------------------

    def encode(
        self,
        inputs: mx.array,
        cache: Optional[List[Any]] = None,
        valid: Optional[mx.array] = None,
        pixel_values=None,
    ) -> mx.array:
        """Causal encoder pass over `inputs` (B, L), appending their K/V to `cache` (one entry per
        layer, from `make_cache()`); returns the final-normed hidden states (B, L, H). `logits(h)`
        turns them into the encoder's own next-token logits.

        `valid` (B, positions encoded so far including `inputs`), for left-padded batches: False
        marks padding, which no query attends to. `pixel_values` (the processor's) are run through
        the vision tower and placed at the image tokens of `inputs`."""
        features = None
        if pixel_values is not None:
            if self.vision_tower is None:
                raise ValueError(
                    f"{_NAME}: this checkpoint has no vision tower (config.json has no "
                    "vision_config), so it cannot read images; give a text-only prompt"
                )
            features = vision.image_features(
                self.vision_tower, self.model.embed_vision, pixel_values
            )
        return self.model.encode(inputs, cache, valid, features, self.args.image_token_id)

    def padding_masks(self, valid: mx.array, canvas_length: int):
        """Decoder keep-masks by layer type for a left-padded batch: `valid` (B, encoded
        positions) False at padding; the canvas sees every encoded real position on full layers,
        the last `sliding_window - 1` on sliding ones, and itself."""
        B, T = valid.shape
        canvas = mx.ones((B, canvas_length), dtype=mx.bool_)
        window = self.args.text_config.sliding_window - 1
        full = mx.concatenate([valid, canvas], axis=1)
        sliding = mx.concatenate([valid[:, max(0, T - window) :], canvas], axis=1)
        return {
            "full_attention": full[:, None, None, :],
            "sliding_attention": sliding[:, None, None, :],
        }

    def decode(
        self,
        canvas: mx.array,
        cache: Optional[List[Any]] = None,
        self_cond_logits: Optional[mx.array] = None,
        mask=None,
        head_span=None,
    ) -> mx.array:
        """Denoiser logits (float32, softcapped) for `canvas` (B, C) after the encoded prefix in
        `cache`, which is read but not written. `self_cond_logits` (B, C, V) are the previous step's
        (processed) logits; None at the first step. `mask` (optional, e.g. for padding) is a keep
        mask over [prefix ; canvas] keys, or a dict of them by layer type (sliding layers see a
        shorter prefix)."""
        h = self.model.decode(canvas, cache, self_cond_logits, mask)
        return self.logits(select_span(h, head_span))

    def logits(self, h: mx.array) -> mx.array:
        out = self.model.embed_tokens.as_linear(h).astype(mx.float32)
        if self.final_logit_softcapping:
            out = gemma4_text.logit_softcap(self.final_logit_softcapping, out)
        return out

    def __call__(self, inputs, cache=None, mask=None, head_span=None):
        """The model protocol: the decoder without self-conditioning, over `cache` read as an
        encoded prefix (an empty one when None)."""
        return self.decode(inputs, cache, None, mask, head_span)

    def make_cache(self):
        w = self.args.text_config.sliding_window
        return [
            RotatingKVCache(max_size=w, keep=0) if layer.self_attn.is_sliding else KVCache()
            for layer in self.layers
        ]

    @property
    def layers(self):
        return self.model.layers

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism over `group`, in mlx-lm's way, over the one set of weights both
        towers read (so the encoder pass and every denoising step are sharded alike): attention
        heads split (K=V full layers included; where a layer has fewer K/V heads than ranks, each
        rank keeps the one its query heads read), the dense MLP and the self-conditioning MLP
        split, the experts split over their intermediate dimension under one all-reduce. The
        router, the tied embedding / head (which self-conditioning also reads back), the
        per-tower layer scalars and the vision tower stay replicated."""
        group = sharding.group_of(group)
        t = self.args.text_config
        sizes = {
            "text_config.num_attention_heads": t.num_attention_heads,
            "text_config.intermediate_size": t.intermediate_size,
            "text_config.moe_intermediate_size": t.moe_intermediate_size,
        }
        kv = {"text_config.num_key_value_heads": t.num_key_value_heads}
        if "full_attention" in t.layer_types:
            kv["num_global_key_value_heads"] = t.num_global_key_value_heads
        sharding.check_divisible(_NAME, group, sizes, kv, model=self)
        for layer in self.layers:
            sharding.shard_attention(layer.self_attn, group)
            sharding.shard_mlp(layer.mlp, group)
            layer.experts.sharding_group = group
            sharding.shard_mlp_inplace(layer.experts.switch_glu, group, _NAME)
        sharding.shard_mlp(self.model.self_conditioning, group)

    # -- checkpoint ------------------------------------------------------------------------------

    def sanitize(self, weights):
        """transformers layout -> this module's. The encoder's text weights are tied to the
        decoder's (the official conversion writes both copies, `save_pretrained` only the decoder
        one): keep one copy, plus the encoder's own `layer_scalar`s. lm_head is the embedding."""
        out, encoder_copy = {}, {}
        for key, value in weights.items():
            if "rotary_emb" in key or key == "lm_head.weight":
                continue
            if key.startswith(("model.vision_tower.", "model.embed_vision.")):
                out[key] = value  # already converted
                continue
            if key.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.")):
                kept = self._sanitize_vision(key, value)
                if kept is not None:
                    out[kept[0]] = kept[1]
                continue
            if key.startswith("model.encoder.language_model."):
                rest = key[len("model.encoder.language_model.") :]
                if rest.endswith(".layer_scalar"):
                    out["model." + rest[: -len("layer_scalar")] + "encoder_layer_scalar"] = value
                else:
                    encoder_copy["model." + rest] = value
                continue
            if key.startswith("model.decoder."):
                key = "model." + key[len("model.decoder.") :]
                if key.endswith(".layer_scalar"):
                    key = key[: -len("layer_scalar")] + "decoder_layer_scalar"
            out[key] = value
        for key, value in encoder_copy.items():
            out.setdefault(key, value)

        for key in [k for k in out if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
            value = out.pop(key)
            base, name = key.rsplit(".", 1)
            if name == "gate_up_proj":
                # [E, 2 * moe_intermediate, hidden], gate rows first (transformers chunks the
                # output in two); SwitchLinear weights are [E, out, in], so no transpose.
                gate, up = mx.split(value, 2, axis=1)
                out[f"{base}.switch_glu.gate_proj.weight"] = gate
                out[f"{base}.switch_glu.up_proj.weight"] = up
            else:
                out[f"{base}.switch_glu.down_proj.weight"] = value
        layout = (
            "transformers' DiffusionGemmaForBlockDiffusion layout (model.decoder.*, "
            "model.encoder.language_model.*, model.encoder.vision_tower.*, lm_head.weight)"
        )
        keys = (
            "text_config (num_hidden_layers, layer_types, hidden_size, head_dim, global_head_dim, "
            "head counts, num_experts, moe_intermediate_size, vocab_size) and vision_config"
        )
        return check_weights(self, out, _NAME, layout, keys)

    def _sanitize_vision(self, key, value):
        """transformers' `model.encoder.{vision_tower,embed_vision}.*` -> `model.*`; dropped for a
        text-only checkpoint, and so are the clipping bounds of a tower that does not clip."""
        if self.vision_tower is None:
            return None
        if not vision.keeps_vision_weight(key, self.args.vision_config):
            return None
        return "model." + key[len("model.encoder.") :], value

    @property
    def quant_predicate(self):
        """Embeddings (also the head and the self-conditioning read-back), attention and the
        router stay at 8 bits; experts, dense MLPs and the rest take the requested bits."""

        def predicate(path, module):
            if path.startswith(("model.vision_tower", "model.embed_vision")):
                return False  # small and sensitive; mlx-vlm keeps vision towers unquantized too
            if path.endswith(("embed_tokens", "router.proj")) or ".self_attn." in path:
                return dict(_EIGHT_BIT)
            return True

        return predicate

    # -- decoding ----------------------------------------------------------------------------------

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        a, t = self.args, self.args.text_config
        eos = eos_token_ids(a.eos_token_id if a.eos_token_id is not None else t.eos_token_id)
        defaults = dict(
            FAMILY_DEFAULTS,
            min_canvas_length=a.canvas_length,
            max_canvas_length=a.canvas_length,
        )
        defaults.update(read_generation_config(a.generation_config or {}, GENERATION_CONFIG_KEYS))
        return DiffusionSpec(
            family=_NAME,
            attention=ENCODER_CANVAS,
            mask_token_id=None,  # uniform noise: the canvas starts from random vocabulary ids
            eos_token_ids=eos,
            confidence="sampled",  # entropy / probability of the temperature-scheduled logits
            samplers=("entropy", "threshold"),
            decoder="canvas",
            defaults=defaults,
            generation_config_keys=GENERATION_CONFIG_KEYS,
            ignored_generation_config_keys=UNREAD_GENERATION_CONFIG_KEYS,
            vocab_size=t.vocab_size,
            max_position_embeddings=t.max_position_embeddings,
        )
