"""LLaDA-V (GSAI-ML/LLaDA-V, `LlavaLLaDAModelLM`, model_type "llava_llada"): LLaDA 8B Instruct
read through a SigLIP vision tower and a two-layer GELU projector, LLaVA-OneVision style.

Transcribed from ML-GSAI/LLaDA-V `train/llava/model/language_model/llava_llada.py` (the model),
`llava_arch.py` (`encode_images`, `prepare_inputs_labels_for_multimodal`: the anyres packing with
`spatial_unpad`, `anyres_max_N` downsampling and the learned `image_newline`),
`multimodal_encoder/siglip_encoder.py` (the tower loses its last encoder layer and its pooling head;
features are the last remaining layer's output, before `post_layernorm`) and
`multimodal_projector/builder.py` (`mlp2x_gelu`: Linear, exact GELU, Linear).

The language model is this package's LLaDA body (models/llada.py), here under Llama names
(`model.layers.N.self_attn.q_proj`, as LLaDA-V's own `modeling_llada.py` writes them, not LLaDA 8B's
OLMo names); it attends bidirectionally and its logits at i predict token i. The vision tower, the
projector and the anyres packing are mlx-vlm's LLaVA-OneVision ones (`mlx_vlm.models.
llava_onevision`: `VisionModel`, `LlavaOnevisionMultiModalProjector`, `Model.get_image_features`),
which implement the same LLaVA-NeXT code; mlx-vlm is imported only when the model is built.

Images reach the engine as token ids: `image_slots(pixel_values, image_size)` runs the tower and
projector once and returns one id per image feature, `vocab_size + k` for the k-th stored feature
row; the forward embeds such ids with the stored features (the reference's `inputs_embeds` with
the features spliced in). The engine, its caches, batching and row selection see only ids, so every
decoder of the LLaDA family applies unchanged.

Decoding: LLaDA's engine with the reference's `generate_with_embeds` recipe (generate_demo.py: 128
tokens in one block of 128, 128 steps, greedy, low-confidence remasking); the logits of
<|endoftext|>, <|startoftext|>, <|start_header_id|> and <|end_header_id|> are -inf at masked
positions (never proposed, their probability mass removed: the spec's logit_suppressed_token_ids),
and the answer ends at <|eot_id|> (its stopping_criteria), where the steps end too once no mask is
left before it, the masks after it never committed (spec.eos_ends_block, eos_bounds_candidates).

LaViDa-LLaDA's checkpoints (jacklishufan/LaViDa) share this model_type: their config.json is an
LLaDAConfig (OLMo names, `d_model`), which ModelArgs.from_dict reads through models/lavida.py; their
language model keeps LLaDA 8B's `model.transformer.*` names, their tiles are pooled before the
packing, and they decode under the prefix-DLM layout (models/lavida.py has the details).
LaViDa-Dream (models/llava_dream.py) is this class over Dream's body.

mlx-vlm: the import hook answers `mlx_vlm.models.llava_llada` with this module (`ModelConfig`,
`Model`, `model.config`), so mlx_vlm.load builds this model and mlx_vlm.convert converts the
checkpoint; the processor that decodes images is this module's `Processor` (what
mlx_dllm_models.load returns), since LLaDA-V ships no processor config.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import BaseModelArgs

from . import lavida, llada, sharding
from .common import (
    ImageTextModel,
    cached_spec,
    check_weights,
    project,
    run_layers,
    unquantized_vision,
)
from .image_slots import ImageSlotError, SlotProcessor, SlotStore

NAME = "llava_llada"
# LLaDA's settings family and rows.
FAMILY = llada.FAMILY
SETTINGS = llada.SETTINGS

# generate_with_embeds' default mask_id (LLaDA 8B's <|mdm_mask|>); LLaDA-V's config names none.
MASK_TOKEN_ID = 126336
# generate_with_embeds sets these logits to -inf at masked positions: <|endoftext|>,
# <|startoftext|>, <|start_header_id|>, <|end_header_id|> (LLaDA 8B's ids).
SUPPRESSED_TOKEN_IDS = (126081, 126080, 126346, 126347)
# generate_demo.py's stopping_criteria: the answer ends at the end of the assistant's turn.
EOS_TOKEN_NAMES = ("<|eot_id|>",)

# generate_demo.py's call: steps=128, gen_length=128, block_length=128, greedy, low_confidence.
REFERENCE_DEFAULTS = {
    "max_tokens": 128,
    "block_length": 128,
    "steps": 128,
    "sampler": "quota",
    "temperature": 0.0,
    "cfg_scale": 0.0,
    "logits_eos_inf": False,
    "confidence_eos_eot_inf": False,
}

# SigLipVisionConfig()'s defaults in siglip_encoder.py (siglip-so400m-patch14-384): LLaDA-V's
# config.json has no vision_config, its tower is built from these.
SIGLIP_SO400M = {
    "hidden_size": 1152,
    "image_size": 384,
    "intermediate_size": 4304,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "layer_norm_eps": 1e-6,
}

# How many stored feature rows image ids may index before the oldest images are forgotten: about
# eight anyres_max_4 images of LLaDA-V (up to ~3,700 rows each), 256 MB in bfloat16.
MAX_STORED_FEATURES = 1 << 15


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = NAME
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    intermediate_size: int = 12288
    vocab_size: int = 126464
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: Optional[int] = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, List[int]]] = None
    # Not in LLaDA-V's config (the reference hard-codes LLaDA 8B's ids); tiny fixtures name theirs.
    suppressed_token_ids: Optional[List[int]] = None
    mm_projector_type: str = "mlp2x_gelu"
    mm_hidden_size: Optional[int] = None
    mm_patch_merge_type: str = "spatial_unpad"
    mm_vision_select_layer: int = -2
    image_aspect_ratio: str = "anyres_max_4"
    image_grid_pinpoints: Optional[List[List[int]]] = None
    # Not in LLaDA-V's config either (SIGLIP_SO400M is its tower): a fixture's smaller tower. Not
    # named vision_config, which mlx-lm's save drops for a model without model.vision_tower.
    vision_tower_config: Optional[Dict[str, Any]] = None
    # LaViDa (models/lavida.py): its config names LLaDA 8B's fields as OLMo does (from_dict reads
    # them into the fields above), and its tiles are pooled before the packing.
    lavida: bool = False
    mm_spatial_pool_mode: str = "bilinear"

    @classmethod
    def from_dict(cls, params):
        if lavida.is_lavida(params):
            params = lavida.llava_fields(params)
        return super().from_dict(params)

    def __post_init__(self):
        if self.mask_token_id is None:
            self.mask_token_id = MASK_TOKEN_ID
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.suppressed_token_ids is None:
            self.suppressed_token_ids = list(SUPPRESSED_TOKEN_IDS)
        self.tower = checked_tower(self)
        # The LLaDA body's config: these fields under LLaDA's OLMo names.
        same = ("vocab_size", "rms_norm_eps", "rope_theta", "mask_token_id", "eos_token_id")
        names = {**llada.LLAMA_NAMES, **{name: name for name in same}}
        fields = {olmo: getattr(self, name) for olmo, name in names.items()}
        self.llada_args = llada.ModelArgs(model_type=NAME, **fields)


# mlx-vlm's loader builds `ModelConfig.from_dict(config)` and `Model(config)`.
ModelConfig = ModelArgs


def checked_tower(args) -> Dict[str, Any]:
    """The SigLIP tower's config of a LLaVA-NeXT vision path (LLaDA-V's, LaViDa's), with its
    config.json fields checked."""
    name = args.model_type
    if args.mm_projector_type != "mlp2x_gelu":
        raise ValueError(
            f"{name}: mm_projector_type {args.mm_projector_type!r} is not supported (only "
            "mlp2x_gelu)"
        )
    if args.image_aspect_ratio in ("pad", "highres", "crop_split"):
        raise ValueError(
            f"{name}: image_aspect_ratio {args.image_aspect_ratio!r} is not supported (anyres, "
            "anyres_max_N, or one resized tile)"
        )
    if args.mm_patch_merge_type != "spatial_unpad":
        raise ValueError(
            f"{name}: mm_patch_merge_type {args.mm_patch_merge_type!r} is not supported (only "
            "spatial_unpad)"
        )
    tower = dict(SIGLIP_SO400M, **(args.vision_tower_config or {}))
    if args.mm_hidden_size is not None and args.mm_hidden_size != tower["hidden_size"]:
        raise ValueError(
            f"{name}: mm_hidden_size {args.mm_hidden_size} differs from the vision tower's "
            f"hidden_size {tower['hidden_size']}"
        )
    return tower


def _onevision_config(args: ModelArgs):
    """mlx-vlm's LLaVA-OneVision config for LLaDA-V's vision path: the tower without its last
    layer, features from the last kept layer ("full": SigLIP has no CLS token), anyres packing."""
    from mlx_vlm.models.llava_onevision.config import ModelConfig, TextConfig, VisionConfig

    tower = dict(args.tower)
    tower["num_hidden_layers"] -= 1  # siglip_encoder.py deletes the last encoder layer
    return ModelConfig(
        text_config=TextConfig(hidden_size=args.hidden_size),
        vision_config=VisionConfig(**tower, vision_use_head=False),
        # LLaVA-NeXT lists pinpoints as (width, height), mlx-vlm (as transformers) as (height,
        # width): transposed, the same candidates come in the same order (ties pick the same).
        image_grid_pinpoints=[[p[1], p[0]] for p in args.image_grid_pinpoints or ()] or None,
        vision_aspect_ratio=args.image_aspect_ratio,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )


def vision_module(args):
    from mlx_vlm.models.llava_onevision import llava_onevision as onevision

    if args.lavida:
        return lavida.vision_module(_onevision_config(args), args.mm_spatial_pool_mode)

    class LlavaVision(onevision.Model):
        """mlx-vlm's LLaVA-OneVision vision path without its language model: the tower, the
        projector, the image newline and the packing (`get_image_features`)."""

        def __init__(self, config):
            nn.Module.__init__(self)
            self.config = config
            self.vision_tower = onevision.VisionModel(config.vision_config)
            self.multi_modal_projector = onevision.LlavaOnevisionMultiModalProjector(config)
            self.image_newline = mx.zeros((config.text_config.hidden_size,))

    return LlavaVision(_onevision_config(args))


# LLaDA-V's names (LLaVA-NeXT's) -> this module's.
_VISION_RENAMES = (
    ("model.vision_tower.vision_tower.", "vision.vision_tower."),
    ("model.mm_projector.0.", "vision.multi_modal_projector.linear_1."),
    ("model.mm_projector.2.", "vision.multi_modal_projector.linear_2."),
    ("model.image_newline", "vision.image_newline"),
)


class Model(ImageTextModel, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = llada.LLaDABody(args.llada_args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.vision = vision_module(args)
        # Outside the parameter tree: mlx's Module would otherwise walk it.
        self.__dict__["slots"] = SlotStore(NAME, args.vocab_size, MAX_STORED_FEATURES)

    @property
    def vision_tower(self):
        return self.vision.vision_tower

    # -- images --------------------------------------------------------------------------------

    def image_features(self, pixel_values, image_size=None) -> mx.array:
        """One image's features in the text width, (n, hidden): `pixel_values` (tiles, 3, S, S),
        the base image first; `image_size` (height, width) unpads the anyres tiles."""
        pixel_values = mx.array(pixel_values)
        if pixel_values.ndim == 3:
            pixel_values = pixel_values[None]
        if pixel_values.shape[0] > 1 and image_size is None:
            raise ImageSlotError(
                f"{NAME}: an anyres image ({pixel_values.shape[0]} tiles) needs its size "
                "(height, width) to unpad its tiles"
            )
        # A single tile is never unpadded: any size will do.
        size = image_size or pixel_values.shape[-2:]
        return self.vision.get_image_features(pixel_values, [list(size)])

    def image_slots(self, pixel_values, image_size=None) -> List[int]:
        """Ids that stand for one image's features in a prompt: the features are computed now and
        kept (the most recent MAX_STORED_FEATURES rows)."""
        self.slots.limit = MAX_STORED_FEATURES  # read at each call: tests lower it
        return self.slots.add(self.image_features(pixel_values, image_size))

    def is_image_id(self, token_id: int) -> bool:
        return self.slots.is_image_id(token_id)

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings, with image ids (>= vocab_size) read from the stored features."""
        return self.slots.embed(self.model.embed_tokens, inputs)

    # -- the protocol ------------------------------------------------------------------------------

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None, embeds=None):
        """Logits (B, R, V); `embeds` (B, L, H), when given, replace the embedding of `inputs`
        (the reference's inputs_embeds)."""
        h = self.embed(inputs) if embeds is None else embeds
        h = run_layers(self.layers, h, cache, mask)
        return project(h, head_span, self.model.norm, self.model.embed_tokens, self.lm_head)

    def sanitize(self, weights):
        out = {}
        for key, value in weights.items():
            if key.endswith(("rotary_emb.inv_freq", "position_ids")):
                continue
            key = llada.rename_olmo(key)  # LaViDa's language model (LLaDA 8B's names)
            old = ""
            for old, new in _VISION_RENAMES:
                if key.startswith(old):
                    key = new + key[len(old) :]
                    break
            else:
                old = ""
            # torch's OIHW -> mlx's OHWI, under the checkpoint's names only (a converted
            # checkpoint's `vision.*` is already OHWI).
            if key.endswith("patch_embedding.weight") and "vision_tower.vision_tower" in old:
                value = value.transpose(0, 2, 3, 1)
            out[key] = value
        keys = "hidden_size, num_hidden_layers, head counts, intermediate_size, vocab_size"
        return check_weights(self, out, self.model_type, self.weight_layout, keys)

    weight_layout = (
        "LLaDA-V's LlavaLLaDAModelLM layout (model.layers.N.self_attn.q_proj, "
        "model.vision_tower.vision_tower.vision_model.*, model.mm_projector.{0,2}, "
        "model.image_newline, lm_head) or LaViDa's (model.transformer.blocks.N.q_proj, the same "
        "vision names)"
    )

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism over `group` as LLaDA 8B's (mlx-lm's llama.Model.shard: heads and
        the MLP split); the vision tower, projector and image newline stay replicated, so every
        rank computes the same image features."""
        group = sharding.checked_gqa_group(self, group, NAME, "intermediate_size")
        return llama.Model.shard(self, group)

    quant_predicate = unquantized_vision("vision")

    def load_processor(self, tokenizer):
        """The processor `mlx_dllm_models.load` returns with this model (see Processor)."""
        return Processor(self, tokenizer)

    @cached_spec
    def diffusion_spec(self):
        a = self.args
        if a.lavida:
            return lavida.diffusion_spec(a)
        suppressed = tuple(t for t in a.suppressed_token_ids if 0 <= t < a.vocab_size)
        return llada.llada_spec(
            a,
            defaults=dict(REFERENCE_DEFAULTS),
            eos_token_names=EOS_TOKEN_NAMES,
            logit_suppressed_token_ids=suppressed,
            vocab_size=a.vocab_size,
            # generate_with_embeds commits nothing after the stopping criterion's token once it
            # is committed, and breaks its step loop once no mask is left before it.
            eos_bounds_candidates=True,
            eos_ends_block=True,
        )


# ------------------------------------------------------------------------------------ processor


class Processor(SlotProcessor):
    """LLaDA-V's prompt encoding: text through the checkpoint's tokenizer, each `<image>` (LLaVA's
    DEFAULT_IMAGE_TOKEN, not a token of LLaDA's vocabulary: tokenizer_image_token splits the text
    there) replaced by the ids of that image's features (`Model.image_slots`).

    Images are preprocessed as process_images does: with image_aspect_ratio "anyres..." (LLaDA-V's
    anyres_max_N) by process_anyres_image (the image resized to one tile first, then the tiles of
    it resized and padded to the best of image_grid_pinpoints), otherwise as one tile; each tile
    as SigLipImageProcessor.preprocess does (resize to the tower's image_size, bicubic; rescale
    1/255; normalize with mean = std = 0.5)."""

    image_token = "<image>"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.size = model.args.tower["image_size"]

    def preprocess(self, image) -> np.ndarray:
        """(1, 3, S, S) float32 pixel values of one PIL image."""
        return siglip_preprocess(image, self.size)

    def tiles(self, image):
        """(tiles, 3, S, S) pixel values of one image and its (height, width)."""
        image = image.convert("RGB")
        args = self.model.args
        if "anyres" not in args.image_aspect_ratio or not args.image_grid_pinpoints:
            return self.preprocess(image), None
        return anyres_tiles(image, self.size, args.image_grid_pinpoints)

    def image_ids(self, image):
        return self.model.image_slots(*self.tiles(image))

    def chunk_ids(self, chunks, add_special_tokens):
        """As mm_utils.tokenizer_image_token (LLaDA-V's llava/mm_utils.py), whose ids the released
        model was trained on: each chunk after an `<image>` encoded alone, with the tokenizer's
        special tokens, and, when the first chunk starts with BOS, its first token dropped (meant
        for a BOS of its own; LLaDA's tokenizer adds none, so the chunk's first text token goes,
        e.g. the "\n" after `<image>` in the demo prompt)."""
        first = list(self.tokenizer.encode(chunks[0], add_special_tokens=add_special_tokens))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        offset = 1 if bos is not None and first[:1] == [bos] else 0
        rest = [list(self.tokenizer.encode(c))[offset:] for c in chunks[1:]]
        return [first] + rest


def best_resolution(size, pinpoints):
    """mm_utils.select_best_resolution: the (width, height) of `pinpoints` that keeps most of the
    image `size` (width, height) when fitted inside, then wastes least; the first on ties."""
    width, height = size
    best, most, least = None, 0, float("inf")
    for w, h in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (w, h), kept, wasted
    return best


def resize_and_pad(image, target):
    """mm_utils.resize_and_pad_image: fitted inside `target` (width, height), centred on black."""
    from PIL import Image

    width, height = image.size
    tw, th = target
    if tw / width < th / height:
        nw, nh = tw, min(math.ceil(height * tw / width), th)
    else:
        nw, nh = min(math.ceil(width * th / height), tw), th
    out = Image.new("RGB", (tw, th), (0, 0, 0))
    out.paste(image.resize((nw, nh)), ((tw - nw) // 2, (th - nh) // 2))
    return out


def siglip_preprocess(image, size: int) -> np.ndarray:
    """SigLipImageProcessor.preprocess of one PIL image: (1, 3, size, size) float32."""
    from transformers.image_transforms import normalize, rescale, resize
    from transformers.image_utils import ChannelDimension, PILImageResampling

    first = ChannelDimension.FIRST
    x = np.array(image.convert("RGB"))
    x = resize(
        x,
        (size, size),
        resample=PILImageResampling.BICUBIC,
        data_format=first,
        input_data_format=ChannelDimension.LAST,
    )
    x = rescale(x, 1 / 255, data_format=first, input_data_format=first)
    x = normalize(x, (0.5,) * 3, (0.5,) * 3, data_format=first, input_data_format=first)
    return x[None].astype(np.float32)


def anyres_tiles(image, size: int, pinpoints):
    """mm_utils.process_anyres_image: the image resized to one tile (its "FIXME" resize, kept),
    then the tiles, row by row, of it resized and padded to the best pinpoint; with its
    (height, width)."""
    best = best_resolution(image.size, pinpoints)
    padded = resize_and_pad(image, best)
    parts = [image.resize((size, size))] + [
        padded.crop((x, y, x + size, y + size))
        for y in range(0, padded.size[1], size)
        for x in range(0, padded.size[0], size)
    ]
    pixels = np.concatenate([siglip_preprocess(p, size) for p in parts], axis=0)
    return pixels, (image.size[1], image.size[0])
