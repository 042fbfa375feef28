"""Independent reference for Nemotron-Labs-Diffusion-VLM (tests only).

The checkpoint's remote code (modeling_nemotron_labs_diffusion_vlm.py, image_processing.py) has no
public copy that could be found; this transcribes what the public code that loads or drives it shows
(zojeda/jevons-rs crates/jevons-nemotron-diffusion and scripts/reference/nemotron_dump.py, which
calls the official model; axolotl's nemotron_diffusion_vlm support, which subclasses it):

* `encode_image(image, max_edge, cell)`: image_processing.encode_image (mistral_common's image
  encoder): ratio = max(h, w) / max_edge; above 1 both sides are divided by it and rounded
  (Python's round); the merged-token grid is ceil(side / 28); the float RGB image is resized to
  the grid's pixels with OpenCV's INTER_CUBIC, divided by 255 and normalized with CLIP's mean and
  std; returns (w tokens, h tokens, (3, H, W) pixels), as the dump unpacks it.
* `build_image_token_str(w, h)`: `<|image_start|>`, then per row w `<|image_pad|>` and
  `<|image_break|>`, the last row closed by `<|image_end|>` instead (1 + h (w + 1) tokens).
* `image_features(ckpt, pixels)`: `get_image_features`: the tower (transformers'
  PixtralVisionModel on the `encoder.vision_tower.*` weights) with output_hidden_states,
  `hidden_states[vision_feature_layer]`, then the projector (transformers'
  Mistral3MultiModalProjector on `encoder.multi_modal_projector.*`: RMSNorm with the text eps, the
  2x2 unfold merge and merging_layer, linear_1, GELU, linear_2) with image_sizes (H, W). Returns
  (tower output, features).
* `embed_prompt(vlm, ids, features, pad_id)`: `_embed_with_vision`: the token embeddings of the
  prompt with the pads' rows replaced by the features in order (masked_scatter).
* `generate(vlm, ids, features, pad_id, ...)`: the language model's generate over that prompt, as
  the dump drives it: the prompt embeddings prefilled causally into the cache, then the text
  family's decoding (tests/reference/nemotron_reference.hf_generate, NVIDIA's `generate`), its
  first forward given the embeddings instead of the ids.

The language model is mlx-vlm's Nemotron-Labs-Diffusion (`text_model`), the text family's
independent reference forward (tests/test_nemotron_forward.py).
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

from .nemotron_reference import VlmForward, hf_generate

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def encode_image(image, max_edge=1400, cell=28):
    import cv2

    w, h = image.size
    ratio = max(h / max_edge, w / max_edge)
    if ratio > 1:
        w = round(w / ratio)
        h = round(h / ratio)
    w_tok = (max(w, 1) - 1) // cell + 1
    h_tok = (max(h, 1) - 1) // cell + 1
    arr = np.array(image.convert("RGB")).astype(np.float32)
    arr = cv2.resize(arr, (w_tok * cell, h_tok * cell), interpolation=cv2.INTER_CUBIC)
    arr = arr / 255.0
    arr = (arr - np.array(CLIP_MEAN)) / np.array(CLIP_STD)
    return w_tok, h_tok, np.ascontiguousarray(arr.transpose(2, 0, 1)).astype(np.float32)


def build_image_token_str(w_tok, h_tok):
    rows = ["<|image_pad|>" * w_tok + "<|image_break|>"] * h_tok
    text = "<|image_start|>" + "".join(rows)
    return text[: -len("<|image_break|>")] + "<|image_end|>"


_CACHE = {}


def _read(ckpt):
    from safetensors.numpy import load_file

    path = Path(ckpt)
    return json.loads((path / "config.json").read_text()), load_file(
        str(path / "model.safetensors")
    )


def _vision(ckpt):
    key = ("vision", str(ckpt))
    if key in _CACHE:
        return _CACHE[key]
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig, PixtralVisionModel
    from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

    config, w = _read(ckpt)
    v = dict(config["vision_config"])
    vcfg = PixtralVisionConfig(**v, attn_implementation="eager")
    tower = PixtralVisionModel(vcfg)
    prefix = "encoder.vision_tower."
    state = {k[len(prefix) :]: torch.from_numpy(x) for k, x in w.items() if k.startswith(prefix)}
    tower.load_state_dict(state, strict=True)
    mcfg = Mistral3Config(
        vision_config=vcfg,
        text_config=MistralConfig(
            hidden_size=config["hidden_size"], rms_norm_eps=config["rms_norm_eps"]
        ),
        spatial_merge_size=config["spatial_merge_size"],
        projector_hidden_act=config["projector_hidden_act"],
        multimodal_projector_bias=config["multimodal_projector_bias"],
        vision_feature_layer=config["vision_feature_layer"],
    )
    projector = Mistral3MultiModalProjector(mcfg)
    prefix = "encoder.multi_modal_projector."
    state = {k[len(prefix) :]: torch.from_numpy(x) for k, x in w.items() if k.startswith(prefix)}
    projector.load_state_dict(state, strict=True)
    tower.eval(), projector.eval()
    _CACHE[key] = (tower, projector, config["vision_feature_layer"])
    return _CACHE[key]


@torch.no_grad()
def image_features(ckpt, pixels):
    """(tower output (patches, hidden), features (merged tokens, text hidden)) of one image's
    (3, H, W) or (1, 3, H, W) pixel values."""
    tower, projector, layer = _vision(ckpt)
    x = torch.from_numpy(np.asarray(pixels, np.float32)).reshape(1, 3, *np.shape(pixels)[-2:])
    sizes = torch.tensor([[x.shape[2], x.shape[3]]])
    out = tower(x, image_sizes=sizes, output_hidden_states=True)
    selected = out.hidden_states[layer]
    features = projector(selected.squeeze(0), sizes)
    return selected.squeeze(0).numpy(), features.numpy()


def text_model(ckpt):
    """mlx-vlm's Nemotron-Labs-Diffusion holding the checkpoint's language weights."""
    from mlx_vlm.models.nemotron_labs_diffusion import Model, ModelConfig

    config, _ = _read(ckpt)
    ref = Model(ModelConfig.from_dict(config))
    weights = mx.load(str(Path(ckpt) / "model.safetensors"))
    vision = ("encoder.vision_tower.", "encoder.multi_modal_projector.")
    weights = {k: v for k, v in weights.items() if not k.startswith(vision)}
    ref.load_weights(list(ref.sanitize(weights).items()))
    mx.eval(ref.parameters())
    return ref


def embed_prompt(vlm, ids, features, pad_id):
    """(1, L, hidden) embeddings of one prompt with its pads' rows replaced by `features`."""
    ids = np.asarray(ids, np.int64).reshape(1, -1)
    h = np.array(vlm.language_model.model.embed_tokens(mx.array(ids)).astype(mx.float32))
    where = np.flatnonzero(ids[0] == pad_id)
    assert len(where) == len(features), (len(where), len(features))
    h[0, where] = np.asarray(features, np.float32)
    return h


def logits(vlm, ids, embeds, causal=False):
    """The language model's float32 logits over a prompt's embeddings (bidirectional by
    default, as a plain forward of the remote code)."""
    out = vlm.language_model(
        mx.array(np.asarray(ids).reshape(1, -1), dtype=mx.int32),
        inputs_embeds=mx.array(embeds),
        use_cache=False,
        use_causal_mask=causal,
    ).logits
    return np.array(out.astype(mx.float32))


class _EmbedsForward(VlmForward):
    """VlmForward whose first call (generate's causal prompt prefill) reads `embeds`."""

    def __init__(self, vlm, embeds):
        super().__init__(vlm)
        self.embeds = embeds

    def __call__(self, ids, past_key_values=None, use_cache=False, use_causal_mask=False):
        if self.embeds is None:
            return super().__call__(ids, past_key_values, use_cache, use_causal_mask)
        embeds, self.embeds = self.embeds, None
        cache = self.vlm.make_cache() if past_key_values is None else past_key_values
        out = self.vlm.language_model(
            mx.array(np.asarray(ids), dtype=mx.int32),
            inputs_embeds=mx.array(embeds),
            cache=cache,
            use_cache=use_cache,
            use_causal_mask=use_causal_mask,
        ).logits
        return np.array(out.astype(mx.float32), dtype=np.float64), cache


def generate(vlm, ids, features, pad_id, **kw):
    """hf_generate over one image prompt: (ids including the prompt, nfe)."""
    embeds = embed_prompt(vlm, ids, features, pad_id)
    return hf_generate(_EmbedsForward(vlm, embeds), [list(ids)], **kw)
