"""DiffusionGemma (google/diffusiongemma-*, `DiffusionGemmaForBlockDiffusion`): uniform-noise block
diffusion on a Gemma-4 MoE text stack.

Reproduces transformers' `models/diffusion_gemma/modular_diffusion_gemma.py` (text part). The
text stack (diffusion_gemma_text, beside this module as mlx-lm's gemma4_text is beside gemma4) is
built on mlx-lm's `gemma4_text` layers (sliding and full attention, proportional RoPE on full
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

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .. import vision
from ..errors import SettingsError
from ..settings_families import Relation, Setting
from ..spec import ENCODER_CANVAS, DiffusionSpec, read_generation_config
from ..validators import int_at_least, is_number, number
from . import sharding
from .common import cached_spec, check_token_ids, check_weights, eos_token_ids, select_span
from .diffusion_gemma_text import (
    NAME,
    DiffusionGemmaLayer,
    DiffusionGemmaTextModel,
    EncoderPrefix,
    Experts,
    PaddingMasks,
    SelfConditioning,
    TextConfig,
    left_padding,
)

# The text stack lives in diffusion_gemma_text (as gemma4_text beside mlx-lm's gemma4); its layers
# stay importable from here, where mlx-lm and the tests look for the family's names.
__all__ = [
    "DiffusionGemmaLayer",
    "DiffusionGemmaTextModel",
    "EncoderPrefix",
    "Experts",
    "FAMILY_DEFAULTS",
    "GENERATION_CONFIG_KEYS",
    "Model",
    "ModelArgs",
    "SelfConditioning",
    "TextConfig",
    "UNREAD_GENERATION_CONFIG_KEYS",
]

# The family's defaults (their one home: the settings table's family rows hold none), with the
# trained canvas_length of config.json (diffusion_spec): transformers'
# DiffusionGemmaGenerationConfig._get_default_generation_params and the official
# generation_config.json; the checkpoint's generation_config overrides them.
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

# ------------------------------------------------------------------------------------- settings

# The settings family of DiffusionGemma's spec.
FAMILY = NAME


def _canvas_row(name, help_text, cli_type, check):
    return Setting(name, None, f"DiffusionGemma: {help_text}", cli_type, check)


# The rows its canvas decoder adds to the shared settings.
SETTINGS = (
    _canvas_row("max_denoising_steps", "denoising steps per canvas at most", int, int_at_least(1)),
    _canvas_row("t_min", "temperature of the last step", float, number(0)),
    _canvas_row("t_max", "temperature of the first step", float, number(0, low_open=True)),
    _canvas_row(
        "stability_threshold",
        "steps the argmax must stay unchanged to stop a canvas",
        int,
        int_at_least(0),
    ),
    _canvas_row(
        "confidence_threshold", "mean entropy below which a stable canvas stops", float, number(0)
    ),
    _canvas_row(
        "min_canvas_length",
        "shortest last canvas (default: the trained canvas length, as transformers; lower it to "
        "shorten the last canvas to the tokens still wanted)",
        int,
        int_at_least(1),
    ),
    _canvas_row("max_canvas_length", "longest canvas (the trained length)", int, int_at_least(1)),
)
RELATIONS = (
    Relation(
        "t_min",
        "t_max",
        lambda lo, hi: hi >= lo,
        "t_max ({t_max}) is the first step's temperature and must be >= t_min ({t_min}), the "
        "last step's",
    ),
    Relation(
        "min_canvas_length",
        "max_canvas_length",
        lambda lo, hi: lo <= hi,
        "min_canvas_length ({min_canvas_length}) exceeds max_canvas_length ({max_canvas_length})",
    ),
)
_WHOLE_DISTRIBUTION = "the sampler draws from the whole temperature-scaled distribution"
# The shared settings its canvas decoder has no use for.
UNUSED_SETTINGS = {
    "block_length": "each canvas is a block; set min_canvas_length / max_canvas_length",
    "steps": "set max_denoising_steps (an upper bound per canvas: a canvas stops once its argmax "
    "is stable and confident)",
    "factor": "its samplers are 'entropy' (entropy_bound) and 'threshold' (threshold)",
    "top_k": _WHOLE_DISTRIBUTION,
}


def scaled_schedule(temperature, settings) -> dict:
    """`temperature` T as the canvas sampler reads it: a scale of its schedule, T * t_max at a
    canvas's first denoising step falling to T * t_min at its last (over the t_min / t_max the
    caller, the checkpoint or the family set), so 1 is the checkpoint's own schedule and lower is
    greedier; 0 is its limit, greedy denoising (every step takes the argmax,
    decoding.canvas.greedy_stats) from the seed's noise canvas."""
    if is_number(temperature) and math.isfinite(temperature) and temperature >= 0:
        scaled = {"t_min": settings.t_min * temperature, "t_max": settings.t_max * temperature}
        if scaled["t_max"] < math.inf:
            return scaled
    raise SettingsError(
        f"temperature must be a number >= 0 for {FAMILY}, got {temperature!r}: it scales the "
        "canvas sampler's t_max -> t_min schedule (1 is the checkpoint's; 0 denoises greedily "
        "from the seed's noise canvas)",
        param="temperature",
    )


def whole_distribution(top_p, settings) -> dict:
    """`top_p` 1 (what OpenAI clients send by default) asks for nothing; below it cannot be
    honoured."""
    if top_p == 1 and not isinstance(top_p, bool):
        return {}
    raise SettingsError(
        f"top_p does not apply to the {FAMILY} family: {_WHOLE_DISTRIBUTION}, so top_p={top_p!r} "
        "cannot be honoured; send top_p 1 or leave it out, and lower temperature (which scales "
        "its t_max -> t_min schedule) for greedier text",
        param="top_p",
    )


# Shared settings it reads in its own terms.
OWN_READINGS = {"temperature": scaled_schedule, "top_p": whole_distribution}

# Kept at 8 bits when the rest is quantized lower: the always-active, precision-sensitive parts.
_EIGHT_BIT = {"group_size": 64, "bits": 8, "mode": "affine"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = NAME
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
                f"{NAME}: tie_word_embeddings=false (separate encoder, decoder and head weights) "
                "is not supported; the released checkpoints tie them."
            )
        # The image ids index the embedding table when a prompt holds an image.
        ids = ("image_token_id", "boi_token_id", "eoi_token_id", "eos_token_id")
        check_token_ids(
            NAME,
            self.text_config.vocab_size,
            {k: getattr(self, k) for k in ids},
            vocab_key="text_config.vocab_size",
        )


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
                    f"{NAME}: this checkpoint has no vision tower (config.json has no "
                    "vision_config), so it cannot read images; give a text-only prompt"
                )
            features = vision.image_features(
                self.vision_tower, self.model.embed_vision, pixel_values
            )
        return self.model.encode(inputs, cache, valid, features, self.args.image_token_id)

    def padding_masks(self, valid: mx.array, canvas_length: int):
        """Decoder keep-masks by layer type for a left-padded batch: `valid` (B, encoded
        positions) False at padding; the canvas sees every encoded real position on full layers,
        the last `sliding_window - 1` on sliding ones, and itself; with each row's padding, which
        decode leaves out of the row's positions."""
        B, T = valid.shape
        canvas = mx.ones((B, canvas_length), dtype=mx.bool_)
        window = self.args.text_config.sliding_window - 1
        full = mx.concatenate([valid, canvas], axis=1)
        sliding = mx.concatenate([valid[:, max(0, T - window) :], canvas], axis=1)
        masks = {
            "full_attention": full[:, None, None, :],
            "sliding_attention": sliding[:, None, None, :],
        }
        return PaddingMasks(masks, left_padding(valid))

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
        sharding.check_divisible(NAME, group, sizes, kv, model=self)
        for layer in self.layers:
            sharding.shard_attention(layer.self_attn, group)
            sharding.shard_mlp(layer.mlp, group)
            layer.experts.sharding_group = group
            sharding.shard_mlp_inplace(layer.experts.switch_glu, group, NAME)
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
        return check_weights(self, out, NAME, layout, keys)

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
            family=FAMILY,
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
            settings=SETTINGS,
            unused_settings=UNUSED_SETTINGS,
            relations=RELATIONS,
            own_readings=OWN_READINGS,
        )
