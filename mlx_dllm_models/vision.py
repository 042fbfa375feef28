"""mlx-vlm glue for image prompts: the Gemma 4 vision tower, its processor, image features into the
prompt.

Reused from mlx-vlm, not copied: `mlx_vlm.models.gemma4.vision.VisionModel` (the tower),
`mlx_vlm.models.gemma4.gemma4.MultimodalEmbedder` (`embed_vision`, the projection into the text
model's width) and `mlx_vlm.models.diffusion_gemma.DiffusionGemma4Processor` (the Gemma 4 image
processor and the expansion of each image placeholder into boi + soft tokens + eoi). mlx-vlm, and
through it transformers and torch, is imported only when a checkpoint has a vision tower.

`mlx_dllm_models.load` returns `(model, processor)` for such a checkpoint (as `mlx_vlm.load` does);
the processor stands in for the tokenizer everywhere, text-only prompts included.
"""

import json
from pathlib import Path
from typing import Any, List, Optional, Sequence

import mlx.core as mx
import numpy as np

# A processor and its text tokenizer are told apart where prompts are written (prompts.py); every
# module that reads images takes them from here.
from .prompts import is_processor, text_tokenizer

__all__ = ["ImageError", "is_processor", "text_tokenizer"]


class ImageError(ValueError):
    pass


# ------------------------------------------------------------------------------------- the tower


def build_vision(vision_config: dict, text_hidden_size: int):
    """(vision_tower, embed_vision) modules for a config.json `vision_config`."""
    from mlx_vlm.models.gemma4.config import VisionConfig
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
    from mlx_vlm.models.gemma4.vision import VisionModel

    config = VisionConfig.from_dict(vision_config)
    tower = VisionModel(config)
    embed = MultimodalEmbedder(
        embedding_dim=config.hidden_size, text_hidden_size=text_hidden_size, eps=config.rms_norm_eps
    )
    return tower, embed


def keeps_vision_weight(key: str, vision_config: dict) -> bool:
    """The clipping bounds of clipped linears exist in the tower only when it clips."""
    clip = ("input_max", "input_min", "output_max", "output_min")
    return vision_config.get("use_clipped_linears", False) or not key.endswith(clip)


def image_features(tower, embed, pixel_values) -> mx.array:
    """Soft tokens of every image, in order, projected to the text width: (n_tokens, hidden)."""
    if isinstance(pixel_values, (list, tuple)):
        pixel_values = [mx.array(p) if not isinstance(p, mx.array) else p for p in pixel_values]
    elif not isinstance(pixel_values, mx.array):
        pixel_values = mx.array(pixel_values)
    return embed(tower(pixel_values))[0]


def place_features(h: mx.array, inputs: mx.array, features: mx.array, image_token_id: int):
    """Put the image features where the prompt holds the image token, in reading order, as
    transformers' masked_scatter does (row-major over the batch)."""
    where = np.flatnonzero(np.array(inputs).reshape(-1) == image_token_id)
    if len(where) != features.shape[0]:
        raise ImageError(
            f"the prompt holds {len(where)} image tokens but the images give {features.shape[0]} "
            "soft tokens; build the prompt with the model's processor (one image placeholder per "
            "image)"
        )
    B, L, H = h.shape
    flat = h.reshape(B * L, H)
    flat[mx.array(where)] = features.astype(h.dtype)
    return flat.reshape(B, L, H)


def vision_blocks(inputs: mx.array, image_token_id: int) -> Optional[mx.array]:
    """(B, L, L) True where query and key lie in the same contiguous run of image tokens: those
    attend to each other both ways in the encoder (transformers' blockwise overlay for
    use_bidirectional_attention="vision"). None when the inputs hold no image token."""
    is_image = inputs == image_token_id
    if not bool(is_image.any().item()):
        return None
    prev = mx.concatenate([mx.zeros_like(is_image[:, :1]), is_image[:, :-1]], axis=1)
    block = mx.cumsum((is_image & ~prev).astype(mx.int32), axis=1)
    block = mx.where(is_image, block, 0)
    return (block[:, :, None] == block[:, None, :]) & is_image[:, :, None]


# --------------------------------------------------------------------------------- the processor


def load_processor(path, trust_remote_code: bool = False, vision_config: Optional[dict] = None):
    """mlx-vlm's DiffusionGemma (Gemma 4) processor for a checkpoint folder.

    `mlx_lm convert` does not copy processor_config.json; without one, the image processor takes
    its patch size, pooling and soft-token budget from the tower's own config, which they must
    match anyway."""
    import warnings

    from mlx_vlm.models.diffusion_gemma import DiffusionGemma4Processor

    path = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = DiffusionGemma4Processor.from_pretrained(
            str(path), trust_remote_code=trust_remote_code
        )
    names = ("processor_config.json", "preprocessor_config.json")
    has_config = any((path / n).exists() for n in names)
    if not has_config and vision_config:
        ip = processor.image_processor
        ip.patch_size = vision_config.get("patch_size", ip.patch_size)
        ip.pooling_kernel_size = vision_config.get("pooling_kernel_size", ip.pooling_kernel_size)
        ip.max_soft_tokens = vision_config.get("default_output_length", ip.max_soft_tokens)
    if not getattr(processor, "image_token", None):
        raise ImageError(
            f"the tokenizer in {path} declares no image token (tokenizer_config.json "
            "extra_special_tokens image_token / boi_token / eoi_token); images cannot be placed "
            "in the prompt"
        )
    return processor


def model_processor(model, tokenizer):
    """The processor a model of this package that encodes its own images (`load_processor`:
    LLaDA-V and the families after it) reads prompts with, around `tokenizer`; anything else is
    returned as it is. `mlx_vlm.load` of such a checkpoint, which ships no processor config,
    finds a bare tokenizer: this is what `load` would have returned with the model."""
    make = getattr(model, "load_processor", None)
    if make is None or getattr(tokenizer, "model", None) is model:
        return tokenizer
    # Another processor (the transformers one a checkpoint's processor_config.json names, e.g.
    # SDAR-VL's LlavaOnevisionProcessor, which expands image tokens itself): its tokenizer.
    tokenizer = text_tokenizer(tokenizer)
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    return make(tokenizer)


def read_images(images: Sequence[Any]) -> List[Any]:
    """PIL images (RGB) from paths, PIL images or HxWx3 uint8 arrays, with a clear error for a
    file that is missing or not an image."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for item in images:
        if isinstance(item, Image.Image):
            out.append(item.convert("RGB"))
        elif isinstance(item, np.ndarray):
            out.append(Image.fromarray(item).convert("RGB"))
        elif isinstance(item, (str, Path)):
            try:
                with Image.open(item) as img:
                    out.append(img.convert("RGB"))
            except FileNotFoundError:
                raise ImageError(f"image {str(item)!r} does not exist") from None
            except (UnidentifiedImageError, OSError) as e:
                raise ImageError(f"could not read image {str(item)!r}: {e}") from None
        else:
            raise ImageError(
                "an image must be a file path, a PIL image or a uint8 array, got "
                f"{type(item).__name__}"
            )
    if not out:
        raise ImageError("image is an empty list: give at least one image, or none")
    return out


def encode_prompt(processor, prompt: str, images: Sequence[Any], add_special_tokens: bool):
    """Token ids and pixel values of a text prompt with images, through the processor. A prompt
    without an image placeholder gets one per image at its start; otherwise it must hold exactly
    one per image."""
    pil = read_images(images)
    token = processor.image_token
    found = prompt.count(token)
    if found == 0:
        prompt = token * len(pil) + prompt
    elif found != len(pil):
        raise ImageError(
            f"the prompt holds {found} image placeholders ({token}) for {len(pil)} images; "
            "give one placeholder per image, or none to put the images first"
        )
    out = processor(text=[prompt], images=pil, add_special_tokens=add_special_tokens)
    ids = [int(t) for t in np.array(out["input_ids"])[0]]
    return ids, out["pixel_values"]


def vision_config_of(path) -> Optional[dict]:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg.get("vision_config")
