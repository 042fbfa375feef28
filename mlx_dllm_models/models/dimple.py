"""Dimple-7B (rp-yu/Dimple-7B, `DimpleModel`, model_type "dimple"): Dream 7B's body read through
Qwen2.5-VL's vision encoder and a two-layer projector, decoded by Dream's engine.

Transcribed from yu-rp/Dimple `training-code/models/modeling_dimple.py` (the model),
`configuration_dimple.py` (its config, whose vision defaults are Qwen2.5-VL-7B's),
`image_processing_dimple.py` / `processing_dimple.py` (Qwen2-VL's dynamic-resolution patches, each
`<|image_pad|>` expanded to one token per merged patch) and `training-code/init.py` (how the
checkpoint was assembled: Dream-v0-Instruct-7B's config and weights, Qwen2.5-VL-7B's vision tower).

The language model is Dream's (mlx-lm's qwen2 layers, attention bidirectional, logits at i predict
token i + 1), with one difference: Dimple's rotary embedding is Qwen2-VL's multimodal RoPE
(`apply_multimodal_rotary_pos_emb`, `mrope_section` [16, 24, 24]) over the (t, h, w) positions of
`get_rope_index`: text advances all three by one a token; an image's tokens sit at the image's start
plus their (t, h, w) grid index, and the text after it resumes at that start plus the grid's largest
side. The vision tower is mlx-vlm's Qwen2.5-VL `VisionModel` (windowed attention, patch merger);
the projector (`img_projector`: Linear, SiLU, Linear) is Dimple's own.

Images reach the engine as token ids (models/image_slots.py): `image_slots(pixel_values,
grid_thw)` runs the tower and projector once and returns one id per merged patch past the
vocabulary; a second store, kept in step, holds each such id's grid index, from which the forward
derives the M-RoPE positions of any window of columns. The engine, its caches, batching and the
server see only ids. A forward that starts after column 0 (the prefill cache of Dimple's recipe,
engine/prefill.py, and Fast-dLLM's) reads the image offsets that the same run's forward from
column 0 left with the K/V (`cache.row_state`).

Decoding: Dream's engine with Dimple's own pipeline, sampler "dimple" (decoding/dimple.py: the
"dim" pipeline's confident decoding and fallback count), under the README's recipe (origin,
alg_p_threshold 0.95, temperature 0.2, top-p 0.95, 64 tokens in 64 steps, cache "prefill" for its
use_cache=True); sampler "dream" is its decoding_pipeline="dream" (lmms-eval's), Dream's own.

mlx-vlm: the import hook answers `mlx_vlm.models.dimple` with this module (`ModelConfig`, `Model`,
`VisionConfig` for the config's `vision_config`), so mlx_vlm.load builds this model and
mlx_vlm.convert converts the checkpoint; the processor that decodes images is `Processor` (what
mlx_dllm_models.load returns). The tower sits at `model.vision_tower`, where mlx-lm's save looks
before keeping `vision_config`.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import qwen2
from mlx_lm.models.base import BaseModelArgs, scaled_dot_product_attention

from ..decoding.dimple import dimple_commit
from ..spec import BIDIRECTIONAL, SHARED_SAMPLERS, TIMESTEP_ELBO
from . import dream, sharding
from .common import (
    QWEN_BODY_FIELDS,
    ImageTextModel,
    build_spec,
    cached_spec,
    check_special_ids,
    check_weights,
    config_fields,
    drop_unused_buffers,
    project,
    unquantized_vision,
)
from .image_slots import ImageSlotError, SlotProcessor, SlotStore

NAME = "dimple"
# Dream's settings family and rows (Dimple's own sampler, "dimple", reads alg_p_threshold).
FAMILY = dream.FAMILY
SETTINGS = dream.SETTINGS
# Its own sampler, the "dim" pipeline (decoding/dimple.py), and Dream's (decoding_pipeline="dream").
SAMPLERS = {"dimple": dimple_commit, **dream.SAMPLERS}

# The README's inference example (yu-rp/Dimple ReadMe.md, the model card's): diffusion_generate(
# max_new_tokens=64, steps=64, temperature=0.2, top_p=0.95, alg="origin", use_cache=True,
# alg_p_threshold=0.95, use_original_confidence=True, decoding_pipeline="dim"). steps stays unset
# so that it follows max_tokens (64 = 64 there); the whole canvas is one block, as there. Its
# use_cache=True is cache="prefill" (engine/prefill.py: the prompt's K/V from the first step,
# an approximation); cache="none" recomputes every step.
REFERENCE_DEFAULTS = {
    "sampler": "dimple",
    "cache": "prefill",
    "alg": "origin",
    "alg_temp": 0.0,
    "alg_p_threshold": 0.95,
    "eps": 1e-3,
    "temperature": 0.2,
    "top_p": 0.95,
    "top_k": None,
    "max_tokens": 64,
}
# The tokenizer's eos_token (init.py sets <|im_end|>): the README and lmms-eval cut the answer
# there; config.json's eos_token_id is Dream's <|endoftext|>.
EOS_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>")

# DimpleVisionConfig's defaults (= Qwen2.5-VL-7B's vision_config).
QWEN25_VL_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}

# Stored image rows before the oldest image is forgotten: about eight 1,000-token images.
MAX_STORED_FEATURES = 1 << 13


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = NAME
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = 32
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mrope_section: List[int] = field(default_factory=lambda: [16, 24, 24])
    full_attn_mask: bool = True
    mask_token_id: Optional[int] = 151666
    pad_token_id: Optional[int] = 151643
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, List[int]]] = None
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    vision_config: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_scaling is not None:
            raise ValueError(f"{NAME}: rope_scaling {self.rope_scaling!r} is not supported (null)")
        if not self.full_attn_mask:
            raise ValueError(
                f"{NAME}: full_attn_mask false (lmms-eval's causal_attention) is not supported; "
                "Dimple decodes with full attention"
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if sum(self.mrope_section) * 2 != head_dim:
            raise ValueError(
                f"{NAME}: mrope_section {self.mrope_section} must sum to half the head dim "
                f"({head_dim // 2})"
            )
        self.tower = dict(QWEN25_VL_VISION, **dict(self.vision_config or {}))
        if self.tower["hidden_act"] != "silu" or self.tower["spatial_merge_size"] != 2:
            raise ValueError(
                f"{NAME}: vision hidden_act {self.tower['hidden_act']!r} / spatial_merge_size "
                f"{self.tower['spatial_merge_size']} are not supported (Qwen2.5-VL's silu / 2)"
            )
        check_special_ids(self)
        fields = config_fields(self, QWEN_BODY_FIELDS)
        self.qwen2_args = qwen2.ModelArgs(model_type="qwen2", **fields)


# mlx-vlm's loader builds `ModelConfig.from_dict(config)`, then `VisionConfig.from_dict` of the
# config's vision_config (kept as a dict: ModelArgs reads it).
ModelConfig = ModelArgs


class VisionConfig(dict):
    @classmethod
    def from_dict(cls, params):
        return dict(params)


def _vision_tower(args: ModelArgs):
    from mlx_vlm.models.qwen2_5_vl.config import VisionConfig as QwenVisionConfig
    from mlx_vlm.models.qwen2_5_vl.vision import VisionModel

    names = QwenVisionConfig.__dataclass_fields__
    tower = {k: v for k, v in args.tower.items() if k in names}
    return VisionModel(QwenVisionConfig(**dict(tower, model_type="qwen2_5_vl")))


class Projector(nn.Module):
    """DimpleMultiModalProjector: Linear, the text model's activation (SiLU), Linear."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.linear_1 = nn.Linear(args.tower["out_hidden_size"], args.hidden_size)
        self.linear_2 = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x):
        return self.linear_2(nn.silu(self.linear_1(x)))


class DimpleBody(nn.Module):
    """DimpleBaseModel's weights (Qwen2's names) and the vision tower."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        q = args.qwen2_args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [qwen2.TransformerBlock(q) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.vision_tower = _vision_tower(args)


def rotate(x, cos, sin):
    """q * cos + rotate_half(q) * sin (Qwen2-VL's, over the two halves of the head)."""
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def mrope_cos_sin(positions, inv_freq, section: Sequence[int], dtype):
    """(cos, sin), (B, 1, L, head_dim), of (3, B, L) positions: frequency band i of each half takes
    the t, h or w position by `section` (apply_multimodal_rotary_pos_emb's split), in float32."""
    freqs = positions.astype(mx.float32)[..., None] * inv_freq  # (3, B, L, D/2)
    bounds = np.cumsum(section)[:-1].tolist()
    parts = mx.split(freqs, bounds, axis=-1)
    freqs = mx.concatenate([p[i] for i, p in enumerate(parts)], axis=-1)
    emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]
    return mx.cos(emb).astype(dtype), mx.sin(emb).astype(dtype)


def attention(attn, x, mask, cache, cos, sin):
    """mlx-lm's qwen2 Attention with the multimodal rotary embedding."""
    B, L, _ = x.shape
    q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _zeros(width):
    return lambda ids: mx.zeros(ids.shape + (width,), mx.float32)


class Model(ImageTextModel, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = DimpleBody(args)
        self.img_projector = Projector(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        head_dim = args.hidden_size // args.num_attention_heads
        self._inv_freq = 1.0 / (
            args.rope_theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
        )
        # Outside the parameter tree. `grid` holds, per stored row, its (t, h, w) grid index, its
        # index within its image and, on an image's last row, how far the text after it moves
        # back (the grid's largest side minus its row count).
        self.__dict__["slots"] = SlotStore(NAME, args.vocab_size, MAX_STORED_FEATURES)
        self.__dict__["grid"] = SlotStore(NAME, args.vocab_size, MAX_STORED_FEATURES)

    @property
    def vision_tower(self):
        return self.model.vision_tower

    # -- images --------------------------------------------------------------------------------

    def image_features(self, pixel_values, grid_thw) -> mx.array:
        """One image's features in the text width, (t * h * w / 4, hidden): `pixel_values` the
        processor's (patches, 3 * 2 * 14 * 14) rows, `grid_thw` its (t, h, w) patch grid."""
        grid = mx.array(np.asarray(grid_thw, dtype=np.int64).reshape(1, 3))
        pixels = mx.array(pixel_values)
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        return self.img_projector(self.model.vision_tower(pixels.astype(dtype), grid))

    def image_slots(self, pixel_values, grid_thw) -> List[int]:
        """Ids that stand for one image's features in a prompt (the features are computed now
        and kept, the most recent MAX_STORED_FEATURES rows)."""
        t, h, w = (int(v) for v in np.asarray(grid_thw).reshape(3))
        m = self.args.tower["spatial_merge_size"]
        if h % m or w % m:
            raise ImageSlotError(f"{NAME}: grid_thw {(t, h, w)} is not a multiple of {m}")
        h, w = h // m, w // m
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        n = t * h * w
        grid = np.stack([ti.ravel(), hi.ravel(), wi.ravel(), np.arange(n), np.zeros(n)], axis=1)
        grid[-1, 4] = max(t, h, w) - n
        feats = self.image_features(pixel_values, grid_thw)
        if feats.shape[0] != n:
            raise ImageSlotError(f"{NAME}: {feats.shape[0]} features for a grid of {n} tokens")
        for store in (self.slots, self.grid):
            store.limit = MAX_STORED_FEATURES  # read at each call: tests lower it
        self.grid.add(mx.array(grid.astype(np.float32)))
        return self.slots.add(feats)

    def is_image_id(self, token_id: int) -> bool:
        return self.slots.is_image_id(token_id)

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings, with image ids (>= vocab_size) read from the stored features."""
        return self.slots.embed(self.model.embed_tokens, inputs)

    def positions(self, inputs: mx.array, cache) -> mx.array:
        """(3, B, L) M-RoPE positions of the forward's columns (get_rope_index's, over the columns
        a left-padded row really holds: `cache.offset` counts its padding)."""
        B, L = inputs.shape
        first = None if cache is None else cache[0]
        offset = 0 if first is None else first.offset
        owner = getattr(first, "owner", None)  # the engine's K/V caches (cache.PrefixKVCache)
        start = 0 if owner is None else owner.start
        grid = self.grid.embed(_zeros(5), inputs).astype(mx.int32)
        back = grid[..., 4]
        shift = mx.cumsum(back, axis=1) - back  # the images wholly before each column
        kept = getattr(owner, "row_state", None)
        if kept is not None and start == 0:
            kept["mrope_shift"] = shift
        elif kept is not None:
            stored = kept.get("mrope_shift")
            if stored is None or stored.shape[0] != B:
                raise ValueError(
                    f"{NAME}: a forward from column {start} needs the same run's forward from "
                    "column 0 first (its image positions)"
                )
            shift = stored[:, start : start + L] + shift
        offset = mx.array(offset, dtype=mx.int32).reshape(-1, 1)
        base = offset + mx.arange(L, dtype=mx.int32)[None] + shift - grid[..., 3]
        return mx.stack([base + grid[..., i] for i in range(3)])

    # -- the protocol ------------------------------------------------------------------------------

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None, embeds=None):
        """Logits (B, R, V); `embeds` (B, L, H), when given, replace the embedding of `inputs`."""
        h = self.embed(inputs) if embeds is None else embeds
        cos, sin = mrope_cos_sin(
            self.positions(inputs, cache), self._inv_freq, self.args.mrope_section, h.dtype
        )
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            mask = mask.astype(h.dtype)
        for i, layer in enumerate(self.layers):
            c = None if cache is None else cache[i]
            h = h + attention(layer.self_attn, layer.input_layernorm(h), mask, c, cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        head = None if self.args.tie_word_embeddings else self.lm_head
        return project(h, head_span, self.model.norm, self.model.embed_tokens, head)

    def sanitize(self, weights):
        weights = drop_unused_buffers(weights)
        out = {}
        for key, value in weights.items():
            if key.startswith("visual."):
                key = "model.vision_tower." + key[len("visual.") :]
                # torch's (O, C, T, H, W) Conv3d -> mlx's (O, T, H, W, C), under the
                # checkpoint's name only (a converted checkpoint's is already mlx's).
                if key.endswith("patch_embed.proj.weight"):
                    value = value.transpose(0, 2, 3, 4, 1)
            out[key] = value
        layout = (
            "Dimple's DimpleModel layout (model.layers.N.self_attn.q_proj with q/k/v biases, "
            "visual.blocks.N.attn.qkv, visual.merger.mlp.{0,2}, img_projector.linear_{1,2}, "
            "lm_head)"
        )
        keys = "hidden_size, num_hidden_layers, head counts, vision_config, vocab_size"
        return check_weights(self, out, NAME, layout, keys)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism over `group` as Dream's (mlx-lm's qwen2.Model.shard: heads and the
        MLP split); the vision tower and projector stay replicated, so every rank computes the
        same image features."""
        group = sharding.checked_group(self, group, NAME, "intermediate_size")
        qwen2.Model.shard(self, group)

    # The projector is of the vision path too.
    quant_predicate = unquantized_vision("model.vision_tower", "img_projector")

    def load_processor(self, tokenizer):
        """The processor `mlx_dllm_models.load` returns with this model (see Processor), with the
        pixel bounds of the checkpoint's preprocessor_config.json when it has one."""
        return Processor(self, tokenizer, **pixel_bounds(getattr(tokenizer, "name_or_path", None)))

    @cached_spec
    def diffusion_spec(self):
        a = self.args
        return build_spec(
            a,
            FAMILY,
            BIDIRECTIONAL,
            "add it to config.json (151666, <|mask|>, for Dimple-7B).",
            logit_shift=1,
            # use_original_confidence=True (the README's): the confidence is the model's own
            # probability of the proposal; the "dream" sampler (decoding_pipeline="dream") always
            # reads the processed one, as Dream's.
            confidence="raw",
            quota_base="masks",
            samplers=("dimple", "dream") + SHARED_SAMPLERS,
            commit_rules=SAMPLERS,
            sampler_spec={"dream": {"confidence": "sampled"}},
            defaults=dict(REFERENCE_DEFAULTS),
            sampling_order=("temperature", "top_p", "top_k"),  # sample_tokens' order
            eos_token_names=EOS_TOKEN_NAMES,
            sampler_defaults={"dimple": {"block_length": None}, "dream": {"block_length": None}},
            vocab_size=a.vocab_size,
            settings=SETTINGS,
            relations=(dream.ALG_RELATION,),
            likelihood=TIMESTEP_ELBO,
        )


# ------------------------------------------------------------------------------------ processor

# Qwen2.5-VL-7B-Instruct's preprocessor_config.json, which init.py loads into Dimple's processor
# (OPENAI_CLIP_MEAN / STD, min_pixels 56 * 56, max_pixels 12845056).
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 3136, 12845056


class Processor(SlotProcessor):
    """Dimple's prompt encoding: text through the checkpoint's tokenizer; each
    `<|vision_start|><|image_pad|><|vision_end|>` (what the chat template writes for an image)
    becomes vision_start, that image's feature ids (`Model.image_slots`), vision_end.

    Images are preprocessed as DimpleImageProcessor (= transformers' Qwen2VLImageProcessor) does:
    resized (bicubic) to smart_resize's multiple of 28 within [min_pixels, max_pixels], rescaled,
    normalized with CLIP's mean and std, repeated to two frames and cut into merged-patch-ordered
    rows of 3 * 2 * 14 * 14 values."""

    image_token = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, model, tokenizer, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
        super().__init__(model, tokenizer)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels

    def preprocess(self, image):
        """(pixel_values (patches, 1176) float32, grid_thw (t, h, w)) of one PIL image."""
        t = self.model.args.tower
        return qwen2vl_patches(
            image,
            t["patch_size"],
            t["spatial_merge_size"],
            t["temporal_patch_size"],
            self.min_pixels,
            self.max_pixels,
        )

    def image_ids(self, image):
        a = self.model.args
        slots = self.model.image_slots(*self.preprocess(image))
        return [a.vision_start_token_id] + slots + [a.vision_end_token_id]


def pixel_bounds(path) -> dict:
    """{min_pixels, max_pixels} of a checkpoint folder's preprocessor_config.json (Qwen2-VL's
    keys, or transformers 5's size {shortest_edge, longest_edge}); {} without one."""
    file = Path(path) / "preprocessor_config.json" if path else None
    if file is None or not file.is_file():
        return {}
    config = json.loads(file.read_text())
    size = config.get("size") or {}
    found = {
        "min_pixels": config.get("min_pixels", size.get("min_pixels", size.get("shortest_edge"))),
        "max_pixels": config.get("max_pixels", size.get("max_pixels", size.get("longest_edge"))),
    }
    return {k: int(v) for k, v in found.items() if v is not None}


def smart_resize(height, width, factor, min_pixels, max_pixels):
    """image_processing_dimple.smart_resize: sides rounded to multiples of `factor`, the area
    brought within [min_pixels, max_pixels] keeping the aspect ratio."""
    if height < factor or width < factor:
        raise ValueError(f"image {width}x{height} is smaller than {factor} pixels on a side")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {width}x{height}: aspect ratio above 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = np.sqrt(height * width / max_pixels)
        h = int(np.floor(height / beta / factor)) * factor
        w = int(np.floor(width / beta / factor)) * factor
    elif h * w < min_pixels:
        beta = np.sqrt(min_pixels / (height * width))
        h = int(np.ceil(height * beta / factor)) * factor
        w = int(np.ceil(width * beta / factor)) * factor
    return h, w


def qwen2vl_patches(image, patch, merge, temporal, min_pixels, max_pixels):
    """DimpleImageProcessor._preprocess of one image: (pixel_values, (1, grid_h, grid_w))."""
    from transformers.image_transforms import normalize, rescale, resize
    from transformers.image_utils import ChannelDimension, PILImageResampling

    first, last = ChannelDimension.FIRST, ChannelDimension.LAST
    x = np.array(image.convert("RGB"))
    h, w = smart_resize(x.shape[0], x.shape[1], patch * merge, min_pixels, max_pixels)
    x = resize(x, (h, w), resample=PILImageResampling.BICUBIC, input_data_format=last)
    x = rescale(x, 1 / 255, input_data_format=last)
    x = normalize(x, IMAGE_MEAN, IMAGE_STD, data_format=first, input_data_format=last)
    frames = np.tile(x[None], (temporal, 1, 1, 1))  # one image: the frame twice
    gh, gw = h // patch, w // patch
    x = frames.reshape(1, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, 3 * temporal * patch * patch).astype(np.float32), (1, gh, gw)
