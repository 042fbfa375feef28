"""SDAR-VL (JetLM/SDAR-VL-Instruct-4B / -8B, JetLM/SDAR-VL-Think-4B / -8B, model_type "sdar_v",
`LlavaOnevisionForConditionalGeneration`): SDAR's block-diffusion text model (models/sdar.py)
reading images through LLaVA-OneVision's SigLIP tower, projector and anyres packing.

Transcribed from JetAstra/SDAR-VL @ cc77ef7a (`training/llama_factory_sdar/inference/sdar_v_4b/`,
`sdar_v_8b/`: config.json, modeling_llava_onevision.py, modeling_sdar.py, chat_template.jinja,
preprocessor_config.json; `generate.py`: block_diffusion_generate). The checkpoint is
transformers' LLaVA-OneVision layout with an SDAR `text_config`:

* `language_model.model.*` / `language_model.lm_head`: SDAR (Qwen3 math; the caller's mask, here
  the engine's block-causal one, as generate.py passes it); plain 1-D positions, no M-RoPE.
* `vision_tower.vision_model.*`: SigLIP (`vision_config`), features `hidden_states[
  vision_feature_layer]` (-1: the last layer, before post_layernorm), "full" (no CLS to drop);
  `multi_modal_projector.linear_{1,2}` (exact GELU between, biases); `image_newline`.
* `LlavaOnevisionModel.pack_image_features` (anyres tiles unpadded, bilinear downsampling past
  `anyres_max_N`, a newline per row; one tile: its features then one newline) is transformers' code
  unchanged, as is mlx-vlm's `llava_onevision.Model.get_image_features`, reused here.
* The features replace the prompt's `<|image_pad|>` (image_token_index) positions in order
  (masked_scatter); the chat template writes one `<|image_pad|>` per image, which
  LlavaOnevisionProcessor expands to the image's feature count.

Images reach the engine as token ids (image_slots.SlotStore): one id past the vocabulary per
feature, so SDAR's decoders, its exact block cache, batching and the server apply unchanged.

Decoding: generate.py's demo call (`block_length=4, denoising_steps=4`, low_confidence_static,
the config's `block_size` 4) stopping at <|im_end|> / <|endoftext|>; SDAR's spec otherwise (see
models/sdar.py: greedy by default, low_confidence_dynamic at 0.9 is the `threshold` sampler).
"""

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs

from . import sdar
from .common import ImageTextModel, cached_spec, check_weights, masked_forward, unquantized_vision
from .image_slots import ImageSlotError, SlotProcessor, SlotStore

NAME = "sdar_v"
# SDAR's settings family and rows.
FAMILY = sdar.FAMILY
SETTINGS = sdar.SETTINGS

# generate.py's __main__: denoising_steps = block_length = 4 (its call swaps the two names; both
# are 4), remasking_strategy "low_confidence_static" (the `quota` sampler), stopping at
# [151645, 151643] (<|im_end|>, <|endoftext|>). It samples at temperature 1.0; greedy is SDAR's
# deterministic default here, as for the text model.
REFERENCE_DEFAULTS = {"sampler": "quota", "steps": 4, "block_length": 4, "max_tokens": 2048}
EOS_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>")
# generate.py's stopping_criteria_idx: those two tokens' ids in SDAR-VL's (Qwen3's) vocabulary.
STOP_TOKEN_IDS = (151645, 151643)

# The checkpoint's preprocessor_config.json (LlavaOnevisionImageProcessor): SigLIP's mean and std,
# bicubic resampling.
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)
RESAMPLE_BICUBIC = 3

# How many stored feature rows image ids may index before the oldest images are forgotten: about
# four anyres_max_9 images (up to ~7,400 rows each), 256 MB at the 8B's width in bfloat16.
MAX_STORED_FEATURES = 1 << 15


class TextConfig:
    """mlx-vlm's loader rebuilds `text_config` and `vision_config` through the module's
    `TextConfig.from_dict` / `VisionConfig.from_dict`; here they stay the plain dicts ModelArgs
    reads."""

    @staticmethod
    def from_dict(params):
        return dict(params)


VisionConfig = TextConfig


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = NAME
    text_config: Dict[str, Any] = field(default_factory=dict)
    vision_config: Dict[str, Any] = field(default_factory=dict)
    image_token_index: int = 151655
    video_token_index: int = 151656
    image_grid_pinpoints: Optional[List[List[int]]] = None
    vision_aspect_ratio: str = "anyres_max_9"
    vision_feature_layer: int = -1
    vision_feature_select_strategy: str = "full"
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True
    use_image_newline_parameter: bool = True
    tie_word_embeddings: bool = False
    # Not in SDAR-VL's config (generate.py hard-codes STOP_TOKEN_IDS); a tiny fixture names its own.
    stop_token_ids: Optional[List[int]] = None

    def __post_init__(self):
        checks = [
            (self.vision_config.get("model_type", "siglip_vision_model"), "siglip_vision_model"),
            (self.projector_hidden_act, "gelu"),
            (self.multimodal_projector_bias, True),
            (self.use_image_newline_parameter, True),
            (isinstance(self.vision_feature_layer, int), True),
            (self.vision_feature_select_strategy, "full"),
        ]
        for got, want in checks:
            if got != want:
                raise ValueError(
                    f"{NAME}: {got!r} where SDAR-VL's config has {want!r} (vision_config."
                    "model_type, projector_hidden_act, multimodal_projector_bias, "
                    "use_image_newline_parameter, an integer vision_feature_layer, "
                    "vision_feature_select_strategy); this configuration is not supported"
                )
        if not self.text_config:
            raise ValueError(f"{NAME}: config.json has no text_config (SDAR's fields)")
        # The text model's head follows the top-level flag (SDAR's text_config names none, and
        # Qwen3's default, tied, is not the checkpoint's).
        text = dict(self.text_config, tie_word_embeddings=self.tie_word_embeddings)
        # The answer ends at the text config's EOS and at generate.py's stopping ids.
        eos = text.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        stops = STOP_TOKEN_IDS if self.stop_token_ids is None else self.stop_token_ids
        vocab = text.get("vocab_size", 0)
        text["eos_token_id"] = eos + [t for t in stops if t not in eos and 0 <= t < vocab]
        self.text = sdar.ModelArgs.from_dict(text)
        self.vocab_size = self.text.vocab_size
        self.hidden_size = self.text.hidden_size


ModelConfig = ModelArgs  # mlx-vlm's name


def onevision_config(args: ModelArgs):
    """mlx-vlm's LLaVA-OneVision config of the checkpoint's vision path."""
    from mlx_vlm.models.llava_onevision.config import ModelConfig as OneVision
    from mlx_vlm.models.llava_onevision.config import TextConfig, VisionConfig

    return OneVision(
        text_config=TextConfig(hidden_size=args.hidden_size),
        vision_config=VisionConfig.from_dict(args.vision_config),
        image_token_index=args.image_token_index,
        image_grid_pinpoints=args.image_grid_pinpoints,
        vision_aspect_ratio=args.vision_aspect_ratio,
        vision_feature_select_strategy=args.vision_feature_select_strategy,
        vision_feature_layer=args.vision_feature_layer,
    )


@functools.lru_cache(maxsize=None)
def onevision_view_class():
    """mlx-vlm's LLaVA-OneVision model over another model's vision modules: its
    get_image_features (tower, feature layer, projector, anyres packing) reads them there."""
    from mlx_vlm.models.llava_onevision import llava_onevision as onevision

    class View(onevision.Model):
        def __init__(self, model):
            nn.Module.__init__(self)
            self.config = model.onevision
            self.vision_tower = model.vision_tower
            self.multi_modal_projector = model.multi_modal_projector
            self.image_newline = model.image_newline

    return View


def onevision_view(model):
    return onevision_view_class()(model)


class Model(ImageTextModel, nn.Module):
    def __init__(self, args: ModelArgs):
        from mlx_vlm.models.llava_onevision import llava_onevision as onevision

        super().__init__(args)
        self.language_model = sdar.Model(args.text)
        # The checkpoint's own names: mlx-vlm's tower and projector, the newline a parameter.
        self.__dict__["onevision"] = onevision_config(args)
        self.vision_tower = onevision.VisionModel(self.onevision.vision_config)
        self.multi_modal_projector = onevision.LlavaOnevisionMultiModalProjector(self.onevision)
        self.image_newline = mx.zeros((args.hidden_size,))
        # Outside the parameter tree: mlx's Module would otherwise walk it.
        self.__dict__["slots"] = SlotStore(NAME, args.vocab_size, MAX_STORED_FEATURES)

    @property
    def layers(self):
        return self.language_model.model.layers

    # -- images --------------------------------------------------------------------------------

    def image_features(self, pixel_values, image_size=None) -> mx.array:
        """One image's packed features in the text width, (n, hidden): `pixel_values` (tiles, 3,
        S, S), the base image first; `image_size` (height, width) unpads the anyres tiles."""
        x = mx.array(np.ascontiguousarray(pixel_values))
        if x.ndim == 3:
            x = x[None]
        if x.ndim != 4 or (x.shape[0] > 1 and image_size is None):
            raise ImageSlotError(
                f"{NAME}: one image's pixel values are (tiles, 3, S, S) with its (height, width) "
                f"when it has several tiles; got shape {tuple(x.shape)}"
            )
        size = list(image_size or x.shape[-2:])  # one tile is never unpadded
        return onevision_view(self).get_image_features(x, [size])

    def image_slots(self, pixel_values, image_size=None) -> List[int]:
        """Ids that stand for one image's features: computed now and kept (the most recent
        MAX_STORED_FEATURES rows)."""
        self.slots.limit = MAX_STORED_FEATURES  # read at each call: tests lower it
        return self.slots.add(self.image_features(pixel_values, image_size))

    def is_image_id(self, token_id: int) -> bool:
        return self.slots.is_image_id(token_id)

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings, with image ids (>= vocab_size) read from the stored features."""
        return self.slots.embed(self.language_model.model.embed_tokens, inputs)

    # -- the protocol ------------------------------------------------------------------------------

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None, embeds=None):
        """Logits (B, R, V) of SDAR's body over the embedded prompt (the reference's
        inputs_embeds); a call with neither mask nor cache reads as the text model's does."""
        lm = self.language_model
        if mask is None and cache is None:
            mask = lm.plain_mask(inputs.shape[1])
        h = self.embed(inputs) if embeds is None else embeds
        return masked_forward(lm, lm.model.embed_tokens, inputs, cache, mask, head_span, h)

    weight_layout = (
        "SDAR-VL's LlavaOnevisionForConditionalGeneration layout (language_model.model.layers.N."
        "self_attn.q_norm, language_model.lm_head, vision_tower.vision_model.*, "
        "multi_modal_projector.linear_{1,2}, image_newline)"
    )

    def sanitize(self, weights):
        text, out = {}, {}
        prefix = "language_model."
        for key, value in weights.items():
            if key.startswith(prefix):
                text[key[len(prefix) :]] = value
                continue
            # torch's OIHW -> mlx's OHWI (a converted checkpoint's is already OHWI).
            if key.endswith("patch_embedding.weight") and value.shape[1] == 3:
                value = value.transpose(0, 2, 3, 1)
            out[key] = value
        for key, value in self.language_model.sanitize(text).items():
            out[prefix + key] = value
        keys = "text_config (SDAR's sizes), vision_config, hidden_size"
        return check_weights(self, out, NAME, self.weight_layout, keys)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism as SDAR's (heads and the MLP split); the vision tower, projector and
        image newline stay replicated, so every rank computes the same image features."""
        self.language_model.shard(group)

    quant_predicate = unquantized_vision("vision_tower", "multi_modal_projector", "image_newline")

    def load_processor(self, tokenizer):
        """The processor `mlx_dllm_models.load` returns with this model (see Processor)."""
        return Processor(self, tokenizer)

    @cached_spec
    def diffusion_spec(self):
        return sdar.sdar_spec(
            self.args.text,
            defaults=REFERENCE_DEFAULTS,
            eos_token_names=EOS_TOKEN_NAMES,
            vocab_size=self.args.vocab_size,
        )


# ------------------------------------------------------------------------------------ processor


class Processor(SlotProcessor):
    """LlavaOnevisionProcessor's prompt encoding: text through the checkpoint's tokenizer, each
    `<|image_pad|>` (what the chat template writes per image) replaced by the ids of that image's
    packed features (`Model.image_slots`), where the reference repeats `<|image_pad|>` as many
    times and scatters the features there. Images go through transformers'
    LlavaOnevisionImageProcessor with the checkpoint's preprocessor_config.json values: the base
    image resized to one tile, then the tiles of the image resized and padded to the best of
    image_grid_pinpoints; each rescaled by 1/255 and normalized with mean = std = 0.5."""

    image_token = "<|image_pad|>"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        try:  # transformers 5's numpy/PIL backend (the default one needs torchvision)
            from transformers import LlavaOnevisionImageProcessorPil as ImageProcessor
        except ImportError:
            from transformers import LlavaOnevisionImageProcessor as ImageProcessor

        size = model.onevision.vision_config.image_size
        pins = model.args.image_grid_pinpoints or [[size, size]]
        self.images = ImageProcessor(
            size={"height": size, "width": size},
            image_grid_pinpoints=pins,
            image_mean=list(IMAGE_MEAN),
            image_std=list(IMAGE_STD),
            resample=RESAMPLE_BICUBIC,
            do_pad=True,
        )

    def preprocess(self, image):
        """((tiles, 3, S, S) float32 pixel values, (height, width)) of one PIL image."""
        out = self.images(images=[image.convert("RGB")], return_tensors="np")
        return np.asarray(out["pixel_values"][0], np.float32), tuple(out["image_sizes"][0])

    def image_ids(self, image) -> List[int]:
        return self.model.image_slots(*self.preprocess(image))
