"""Nemotron-Labs-Diffusion-VLM (nvidia/Nemotron-Labs-Diffusion-VLM-8B, `NemotronLabsDiffusionVLMModel`,
model_type "nemotron_labs_diffusion_vlm"): the Nemotron-Labs-Diffusion-8B body (models/
nemotron_labs_diffusion.py, unchanged) reading images through a Pixtral vision tower and Mistral-3's
patch-merger projector.

The checkpoint's remote code (modeling_nemotron_labs_diffusion_vlm.py, image_processing.py) was not
found in a public copy; what it does is read from code that loads or drives it:

* zojeda/jevons-rs `crates/jevons-nemotron-diffusion` (vision.rs, image.rs, model.rs), a port that
  loads the real checkpoint and is checked against the official implementation
  (scripts/reference/nemotron_dump.py calls its `get_image_features`, `_embed_with_vision` and
  image_processing's `encode_image` / `build_image_token_str`);
* axolotl's `nemotron_diffusion_vlm` support, which subclasses the remote code: the vision modules
  sit at `encoder.vision_tower` and `encoder.multi_modal_projector`, features are
  `vision_tower(..., output_hidden_states=True).hidden_states[vision_feature_layer]` through
  `multi_modal_projector(features, image_sizes)`, scattered where the prompt holds the image token.

So: the tower is transformers' PixtralVisionModel (2D RoPE over patch rows and columns, SiLU MLP,
RMSNorm), the projector Mistral-3's (RMSNorm with the text eps, 2x2 unfold merge and
`patch_merger.merging_layer`, linear_1, exact GELU, linear_2, no biases). Both are mlx-vlm's
(`mlx_vlm.models.pixtral.VisionModel`, `mlx_vlm.models.mistral3.Mistral3MultiModalProjector`),
imported when the model is built. An image of w x h merged tokens enters the prompt as
`<|image_start|>`, then per row w `<|image_pad|>` and `<|image_break|>`, the last row's break being
`<|image_end|>`; the features replace the pads, in raster order, and the markers keep their
embeddings.

Images reach the engine as token ids (image_slots.SlotStore): each pad becomes an id past the
vocabulary that indexes the stored features, so the causal prompt prefill, the AR-seeded blocks,
self-speculation, batching and the server of the text family apply unchanged. As in the reference,
the prompt with its image is prefilled causally (jevons-rs's reference dump: `_embed_with_vision`,
then `encoder(inputs_embeds, use_causal_mask=True)`).

Preprocessing (`encode_image`, image_processing.py as jevons-rs transcribes it, mistral_common's
image encoder): the longest edge scaled down to at most 1400 pixels (Python's round), the size
rounded up to 28-pixel cells (patch 14 x merge 2), OpenCV's INTER_CUBIC on float pixels (cv2 comes
with mlx-vlm), x / 255, CLIP mean and std.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import nemotron_labs_diffusion as text
from .common import check_weights, drop_tied_head, drop_unused_buffers, unquantized_vision
from .image_slots import ImageSlotError, SlotProcessor, SlotStore

NAME = "nemotron_labs_diffusion_vlm"
# The text model's settings family and rows.
FAMILY = text.FAMILY
SETTINGS = text.SETTINGS

# build_image_token_str's markers; the features replace the pads.
IMAGE_START, IMAGE_PAD, IMAGE_BREAK, IMAGE_END = (
    "<|image_start|>",
    "<|image_pad|>",
    "<|image_break|>",
    "<|image_end|>",
)
# image_processing.py: the longest edge is scaled down to this many pixels.
MAX_EDGE = 1400
# CLIP's mean and standard deviation, as image_processing.py writes them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# How many stored feature rows image ids may index before the oldest images are forgotten: about
# thirteen 1400-pixel images (2,500 merged tokens each), 256 MB in bfloat16.
MAX_STORED_FEATURES = 1 << 15


class VisionConfig:
    """mlx-vlm's loader rebuilds `vision_config` through the module's `VisionConfig.from_dict`;
    here it stays the plain dict this module reads."""

    @staticmethod
    def from_dict(params):
        return dict(params)


@dataclass
class ModelArgs(text.ModelArgs):
    vision_config: Optional[dict] = None
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = False
    vision_feature_layer: int = -1

    def __post_init__(self):
        super().__post_init__()
        v = self.vision_config
        if not v:
            raise ValueError(
                f"{NAME}: config.json has no vision_config; the checkpoint's Pixtral tower needs "
                "it (a text-only checkpoint is model_type nemotron_labs_diffusion)"
            )
        rope = v.get("rope_parameters") or {}
        heads, hidden = v.get("num_attention_heads", 16), v.get("hidden_size", 1024)
        checks = [
            (v.get("model_type", "pixtral") == "pixtral", "vision_config.model_type"),
            (v.get("hidden_act", "silu") == "silu", "vision_config.hidden_act"),
            (rope.get("rope_type", "default") == "default", "vision_config rope_type"),
            (v.get("head_dim", hidden // heads) * heads == hidden, "vision_config.head_dim"),
            (v.get("num_channels", 3) == 3, "vision_config.num_channels"),
            (self.projector_hidden_act == "gelu", "projector_hidden_act"),
            (self.spatial_merge_size >= 1, "spatial_merge_size"),
            (isinstance(self.vision_feature_layer, int), "vision_feature_layer"),
        ]
        bad = [what for ok, what in checks if not ok]
        if bad:
            raise ValueError(
                f"{NAME}: {bad[0]} is not supported (the checkpoint's Pixtral tower: model_type "
                "pixtral, SiLU, default RoPE, head_dim x heads = hidden_size, 3 channels; a GELU "
                "projector; one integer vision_feature_layer)"
            )


# mlx-vlm's loader builds `ModelConfig.from_dict(config)` and `Model(config)`.
ModelConfig = ModelArgs


def _vision_modules(args: ModelArgs):
    """mlx-vlm's Pixtral tower and Mistral-3 projector for this config."""
    from mlx_vlm.models.mistral3.mistral3 import Mistral3MultiModalProjector
    from mlx_vlm.models.pixtral import VisionModel
    from mlx_vlm.models.pixtral.config import VisionConfig as PixtralConfig

    v = dict(args.vision_config)
    rope = v.get("rope_parameters") or {}
    v["rope_theta"] = rope.get("rope_theta", v.get("rope_theta", 10000.0))
    v["model_type"] = "pixtral"
    vision = PixtralConfig.from_dict(v)
    vision.head_dim = vision.hidden_size // vision.num_attention_heads
    projector = SimpleNamespace(
        vision_config=vision,
        text_config=SimpleNamespace(hidden_size=args.hidden_size, rms_norm_eps=args.rms_norm_eps),
        spatial_merge_size=args.spatial_merge_size,
        vision_feature_layer=args.vision_feature_layer,
        multimodal_projector_bias=args.multimodal_projector_bias,
    )
    return VisionModel(vision), Mistral3MultiModalProjector(projector)


# The checkpoint's names (the remote code's modules under `encoder`) -> this module's.
_VISION_RENAMES = (
    ("encoder.vision_tower.", "model.vision_tower.vision_model."),
    ("encoder.multi_modal_projector.", "model.multi_modal_projector."),
)


class Model(text.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.config = args  # mlx-vlm's name for it
        # Under `model` so that mlx-lm's save keeps vision_config ("vision_tower" in model.model).
        self.model = nn.Module()
        self.model.vision_tower, self.model.multi_modal_projector = _vision_modules(args)
        # The tower's RoPE table is no parameter, so loading never evaluates it; evaluated here, it
        # is not a lazy graph of this thread's stream when the server's worker thread reads it.
        mx.eval(self.vision_tower.vision_model.patch_positional_embedding.inv_freq)
        # Outside the parameter tree: mlx's Module would otherwise walk it.
        self.__dict__["slots"] = SlotStore(NAME, args.vocab_size, MAX_STORED_FEATURES)

    @property
    def vision_tower(self):
        return self.model.vision_tower

    @property
    def multi_modal_projector(self):
        return self.model.multi_modal_projector

    # -- images --------------------------------------------------------------------------------

    def image_features(self, pixel_values) -> mx.array:
        """One image's features in the text width, (h * w merged tokens in raster order, hidden):
        `pixel_values` (1, 3, H, W) or (3, H, W), H and W multiples of patch_size x merge."""
        if isinstance(pixel_values, np.ndarray):  # mlx reads no negative strides (flips)
            pixel_values = np.ascontiguousarray(pixel_values)
        x = mx.array(pixel_values)
        if x.ndim == 3:
            x = x[None]
        cell = self.vision_tower.vision_model.patch_size * self.args.spatial_merge_size
        if x.ndim != 4 or x.shape[0] != 1 or x.shape[2] % cell or x.shape[3] % cell:
            raise ImageSlotError(
                f"{NAME}: one image's pixel values are (1, 3, H, W) with H and W multiples of "
                f"{cell}, got shape {tuple(x.shape)}; preprocess images with the model's processor"
            )
        sizes = [(x.shape[2], x.shape[3])]
        *_, hidden = self.vision_tower(
            x.transpose(0, 2, 3, 1), output_hidden_states=True, image_sizes=sizes
        )
        return self.multi_modal_projector(hidden[self.args.vision_feature_layer][0], sizes)

    def image_slots(self, pixel_values) -> List[int]:
        """Ids that stand for one image's features, in raster order: computed now and kept (the
        most recent MAX_STORED_FEATURES rows)."""
        self.slots.limit = MAX_STORED_FEATURES  # read at each call: tests lower it
        return self.slots.add(self.image_features(pixel_values))

    def is_image_id(self, token_id: int) -> bool:
        return self.slots.is_image_id(token_id)

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings, with image ids (>= vocab_size) read from the stored features."""
        return self.slots.embed(self.encoder.embed_tokens, inputs)

    # -- weights -------------------------------------------------------------------------------

    def sanitize(self, weights):
        out, origin = {}, {}
        for key, value in drop_unused_buffers(weights).items():
            if key.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
                continue
            new = key
            for old, renamed in _VISION_RENAMES:
                if key.startswith(old):
                    new = renamed + key[len(old) :]
                    # torch's OIHW -> mlx's OHWI, under the checkpoint's names only (a converted
                    # checkpoint's `model.vision_tower.*` is already OHWI).
                    if new.endswith("patch_conv.weight"):
                        value = value.transpose(0, 2, 3, 1)
                    break
            out[new] = value
            origin[new] = key
        drop_tied_head(out, NAME, self.args.tie_word_embeddings, "diffusion_head.weight")
        out = text.ministral3.Model.sanitize(self, out)  # FP8 scales folded, as the text model
        layout = (
            "Nemotron-Labs-Diffusion-VLM's layout (encoder.layers.N.*, encoder.embed_tokens, "
            "encoder.norm, diffusion_head, encoder.vision_tower.{patch_conv,ln_pre,transformer.*}, "
            "encoder.multi_modal_projector.{norm,patch_merger.merging_layer,linear_1,linear_2})"
        )
        keys = "num_hidden_layers, vocab_size, hidden_size, intermediate_size, heads, vision_config"
        return check_weights(self, out, NAME, layout, keys, origin)

    quant_predicate = unquantized_vision("model.")  # the vision tower and projector

    def load_processor(self, tokenizer):
        """The processor `mlx_dllm_models.load` returns with this model (see Processor)."""
        return Processor(self, tokenizer)


# ------------------------------------------------------------------------------------ processor


def image_grid(width: int, height: int, cell: int, max_edge: int = MAX_EDGE):
    """image_processing.py's merged-token grid (w, h) of an image: the longest edge scaled down
    to `max_edge` (Python's round, halves to even), then rounded up to `cell`-pixel cells."""
    ratio = max(height / max_edge, width / max_edge)
    if ratio > 1:
        width, height = round(width / ratio), round(height / ratio)
    return (max(width, 1) - 1) // cell + 1, (max(height, 1) - 1) // cell + 1


def encode_image(image, cell: int = 28, max_edge: int = MAX_EDGE):
    """image_processing.encode_image of one PIL image: ((1, 3, h * cell, w * cell) float32 pixel
    values, (w, h) merged tokens)."""
    import cv2

    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    w, h = image_grid(rgb.shape[1], rgb.shape[0], cell, max_edge)
    x = cv2.resize(rgb, (w * cell, h * cell), interpolation=cv2.INTER_CUBIC)
    x = (x / 255.0 - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)
    return x.transpose(2, 0, 1)[None].astype(np.float32), (w, h)


class Processor(SlotProcessor):
    """The prompt encoding of Nemotron-Labs-Diffusion-VLM: text through the checkpoint's
    tokenizer; each `<image>` placeholder (split out of the text, not a token) replaced by
    build_image_token_str's block, whose pads are the ids of that image's features
    (`Model.image_slots`). The marker ids are the tokenizer's own."""

    image_token = "<image>"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        tower = model.vision_tower.vision_model
        self.cell = tower.patch_size * model.args.spatial_merge_size
        # The tower's RoPE covers image_size / patch_size patches a side: a checkpoint whose
        # image_size is below 1400 (a test's) caps its images there instead.
        self.max_edge = min(MAX_EDGE, tower.config.image_size)

    def preprocess(self, image):
        """((1, 3, H, W) float32 pixel values, (w, h) merged tokens) of one PIL image."""
        return encode_image(image, self.cell, self.max_edge)

    def marker_ids(self):
        ids = [self.tokenizer.convert_tokens_to_ids(m) for m in (IMAGE_START, IMAGE_BREAK)]
        ids.append(self.tokenizer.convert_tokens_to_ids(IMAGE_END))
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if any(i is None or i == unk for i in ids):
            raise ImageSlotError(
                f"{NAME}: the tokenizer has no {IMAGE_START} / {IMAGE_BREAK} / {IMAGE_END} "
                "token, which frame an image in the prompt; use the checkpoint's tokenizer"
            )
        return ids

    def image_ids(self, image) -> List[int]:
        """build_image_token_str's block for one image, its pads as feature ids."""
        start, brk, end = self.marker_ids()
        pixels, (w, h) = self.preprocess(image)
        slots = self.model.image_slots(pixels)
        ids = [start]
        for row in range(h):
            ids += slots[row * w : (row + 1) * w] + [end if row == h - 1 else brk]
        return ids
