"""LaViDa on LLaDA (jacklishufan/LaViDa, arXiv 2505.16839; `LlavaLladaForMaskedDiffusion`): what
its checkpoints add to LLaDA-V's model_type "llava_llada", which they share (models/llava_llada.py
reads both and tells them apart here).

Transcribed from jacklishufan/LaViDa `llava/model/language_model/llava_llada.py` (the model: a
`LlavaLladaConfig(LLaDAConfig)`, so config.json holds LLaDA 8B's OLMo field names, `d_model`,
`n_layers`, ..., and the language model's weights LLaDA 8B's `model.transformer.*` names, where
LLaDA-V writes Llama names), `llava/model/llava_arch.py` (`prepare_inputs_labels_for_multimodal`:
each tile's projected features go through `get_2dPool` before the anyres packing, since
ALWASY_DO_2DPOOL is on unless NOT_ALWASY_DO_2DPOOL is set; `mm_spatial_pool_mode` bilinear (the
training default) or average, stride 2; the base tile's side is read from the pooled features) and
`llava/model/language_model/llada/generate.py` (`generate` with prefix_lm=True: the prompt's K/V
computed once, alone, then every step runs the whole answer against them: spec.PREFIX_DLM and
engine/prefix_dlm.py, `cache="prefix"`, the default; its prefix_lm=False, the README's "KV cache
off" rows and eval/run.sh's run (its `refix_lm=True` never reaches generate), is `cache="none"`,
LLaDA's full recompute attending everywhere). The vision tower, projector and preprocessing are
LLaDA-V's (both come from LLaVA-NeXT's siglip_encoder.py, mm_utils.py and mlp2x_gelu).

Decoding defaults: predict.py's first call and eval/run.sh's lmms-eval wrapper (greedy,
low_confidence remasking, one block, a step per token), 64 tokens (predict.py's max_new_tokens).
The faster recipe of predict.py's timed call and run_coco.sh (the README's "50% NFE" rows:
step_ratio 0.5, schedule="shift") is sampler="lavida", schedule="shift" and half the steps
(decoding/lavida.py). Its generate neither suppresses tokens nor stops early; the answer is read
up to LLaDA's end of turn or end of text.
"""

import math

import mlx.core as mx
import numpy as np

from ..spec import MASK_COUNT_ELBO, PREFIX_DLM
from . import llada
from .common import build_spec

NAME = "llava_llada"

# predict.py: max_new_tokens=64, block_length=64, step_ratio=1.0 (64 steps), temperature 0;
# run.sh's wrapper: block_length min(128, max_new_tokens), step_per_block = block_length.
REFERENCE_DEFAULTS = {
    "max_tokens": 64,
    "block_length": 64,
    "steps": 64,
    "sampler": "quota",
    "temperature": 0.0,
    "cfg_scale": 0.0,
    "logits_eos_inf": False,
    "confidence_eos_eot_inf": False,
}
# LLaDA's remasking options that its generate offers (low_confidence, random), and its schedules.
SAMPLERS = tuple(s for s in llada.LLADA_SAMPLERS if s != "d3llm") + ("lavida",)
EOS_TOKEN_NAMES = ("<|eot_id|>",)
POOL_MODES = ("bilinear", "average")


def is_lavida(params: dict) -> bool:
    """LaViDa's config is an LLaDAConfig (OLMo names); LLaDA-V's has Llama names."""
    return "d_model" in params


def llava_fields(params: dict) -> dict:
    """`params` with LLaDA 8B's OLMo fields under the names llava_llada.ModelArgs reads."""
    for key in ("include_bias", "weight_tying", "alibi", "input_emb_norm"):
        if params.get(key):
            raise ValueError(
                f"{NAME}: LaViDa checkpoint with {key}=true is not supported (LLaDA 8B's body has "
                "no biases, an untied head, RoPE and no embedding norm)"
            )
    mode = checked_pool_mode(NAME, params.get("mm_spatial_pool_mode"))
    out = dict(params)
    out.update({llama: params.get(olmo) for olmo, llama in llada.LLAMA_NAMES.items()})
    out.update(
        # OLMo sizes the embedding and the head by embedding_size (the padded vocabulary).
        vocab_size=params.get("embedding_size") or params.get("vocab_size"),
        mm_spatial_pool_mode=mode,
        lavida=True,
    )
    return {k: v for k, v in out.items() if v is not None}


def checked_pool_mode(name: str, mode) -> str:
    """config.json's mm_spatial_pool_mode (train.py's default, bilinear, when absent)."""
    mode = mode or "bilinear"
    if mode not in POOL_MODES:
        raise ValueError(
            f"{name}: mm_spatial_pool_mode {mode!r} is not supported (one of {POOL_MODES})"
        )
    return mode


def pool(features: mx.array, side: int, mode: str) -> mx.array:
    """get_2dPool (stride 2) of each tile's (side * side, C) features: bilinear resizes to
    ceil(side / 2) (F.interpolate, align_corners=False, no antialias); average is avg_pool2d
    (the last odd row and column dropped)."""
    from mlx_vlm.models.interpolate import resize_bilinear

    tiles, _, dim = features.shape
    grid = features.reshape(tiles, side, side, dim)
    if mode == "average":
        half = side // 2
        grid = grid[:, : 2 * half, : 2 * half].reshape(tiles, half, 2, half, 2, dim)
        grid = grid.mean(axis=(2, 4))
    else:
        half = math.ceil(side / 2)
        grid = grid.transpose(0, 3, 1, 2)
        grid = resize_bilinear(grid, (half, half), antialias=False).transpose(0, 2, 3, 1)
    return grid.reshape(tiles, half * half, dim)


def vision_module(config, pool_mode: str):
    """mlx-vlm's LLaVA-OneVision vision path (the tower, projector, image newline and packing)
    with LaViDa's pooling of every tile between the projector and the packing."""
    from mlx_vlm.models.llava_onevision import llava_onevision as onevision

    class LavidaVision(onevision.Model):
        def __init__(self, config):
            onevision.nn.Module.__init__(self)
            self.config = config
            self.vision_tower = onevision.VisionModel(config.vision_config)
            self.multi_modal_projector = onevision.LlavaOnevisionMultiModalProjector(config)
            self.image_newline = mx.zeros((config.text_config.hidden_size,))

        @property
        def tower_side(self) -> int:
            v = self.config.vision_config
            return v.image_size // v.patch_size

        @property
        def patches_per_side(self) -> int:  # the packing reads the pooled grid
            return (
                math.ceil(self.tower_side / 2) if pool_mode != "average" else self.tower_side // 2
            )

        @property
        def max_num_patches(self) -> int:
            ratio = self.config.vision_aspect_ratio
            if ratio.startswith("anyres_max_"):
                return int(ratio[len("anyres_max_") :])
            return np.iinfo(np.int32).max  # "anyres": the unpadded tiles are never downsampled

        def get_image_features(self, pixel_values, image_sizes):
            """Tower (its last kept layer) -> projector -> pool -> anyres packing, (n, hidden)."""
            *_, hidden = self.vision_tower(
                pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True
            )
            features = self.multi_modal_projector(hidden[-1])
            features = pool(features, self.tower_side, pool_mode)
            sizes = np.array(image_sizes).reshape(-1, 2).tolist()
            return self.pack_image_features([features], sizes)[0]

    return LavidaVision(config)


def diffusion_spec(a):
    """LLaDA's decoding under the prefix-DLM layout, with the reference's defaults."""
    return build_spec(
        a,
        llada.FAMILY,
        PREFIX_DLM,
        settings=llada.SETTINGS,
        likelihood=MASK_COUNT_ELBO,
        logit_shift=0,
        confidence="raw",
        quota_base="masks",
        samplers=SAMPLERS,
        defaults=dict(REFERENCE_DEFAULTS),
        threshold_keeps_lowest=True,
        eot_token_names=llada.EOT_TOKENS,
        eos_token_names=EOS_TOKEN_NAMES,
        vocab_size=a.vocab_size,
    )
