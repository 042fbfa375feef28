"""LaViDa-Dream (jacklishufan/lavida-dream-v1.0-instruct, `LlavaDreamForMaskedDiffusion`, model_type
"llava_dream"): Dream 7B (models/dream.py) read through LaViDa's vision path (models/lavida.py:
LLaDA-V's SigLIP tower and mlp2x_gelu projector, each tile pooled before the anyres packing).

Transcribed from jacklishufan/LaViDa `llava/model/language_model/llava_dream.py` (a
`LlavaDreamConfig(DreamConfig)`: Dream's Qwen2 field names plus the LLaVA fields train.py writes;
`LlavaDreamModel(LlavaMetaModel, DreamBaseModel)`, so the language model keeps Dream's names,
`model.layers.N.*`, `model.embed_tokens`, `model.norm`, `lm_head`, beside `model.vision_tower.*`,
`model.mm_projector.*`, `model.image_newline`) and `llava/model/language_model/dream/
generation_utils.py` (`_sample` with prefix_lm=True: the prompt's K/V computed alone, once
(`DreamPrefixLMCache` never grows past the prefill); the prefill's last logit, argmax, seeds the
answer's first column; then Dream's diffusion_generate over the answer against that cache, the
answer's logits shifted right by one within it: spec.PREFIX_DLM, engine/prefix_dlm.py,
`cache="prefix"`, the default; prefix_lm=False is `cache="none"`, Dream's own full recompute).

Decoding defaults: eval/run_dream.sh and the lmms-eval wrapper (`alg=topk_margin`, prefix_lm,
temperature 0, top_p None, steps = max_new_tokens (generate's steps=512 capped by
min(steps, max_new_tokens)), 256 new tokens); the answer ends at <|im_end|> (the wrapper strips
it).

The model is LLaDA-V's class (llava_llada.Model: images as ids past the vocabulary, the
processor, sanitize's vision renames) over mlx-lm's Qwen2 body.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen2

from ..spec import PREFIX_DLM, SHARED_SAMPLERS, TIMESTEP_ELBO
from . import dream, lavida, llava_llada, sharding
from .common import build_spec, cached_spec
from .image_slots import SlotStore

NAME = "llava_dream"
# Dream's settings family, rows and sampler.
FAMILY = dream.FAMILY
SETTINGS = dream.SETTINGS
SAMPLERS = dream.SAMPLERS

REFERENCE_DEFAULTS = {
    "sampler": "dream",
    "alg": "topk_margin",
    "alg_temp": 0.0,
    "eps": 1e-3,
    "temperature": 0.0,
    "top_p": None,
    "top_k": None,
    "max_tokens": 256,
}


@dataclass
class ModelArgs(dream.ModelArgs):
    mm_projector_type: str = "mlp2x_gelu"
    mm_hidden_size: Optional[int] = None
    mm_patch_merge_type: str = "spatial_unpad"
    mm_vision_select_layer: int = -2
    mm_spatial_pool_mode: Optional[str] = None
    image_aspect_ratio: str = "anyres"
    image_grid_pinpoints: Optional[List[List[int]]] = None
    # Not in LaViDa's config (its tower is SigLIP-so400m): a fixture's smaller tower.
    vision_tower_config: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        super().__post_init__()
        self.lavida = True  # llava_llada.vision_module: the tiles are pooled
        self.mm_spatial_pool_mode = lavida.checked_pool_mode(NAME, self.mm_spatial_pool_mode)
        self.tower = llava_llada.checked_tower(self)


ModelConfig = ModelArgs  # mlx-vlm's name


class Model(llava_llada.Model):
    weight_layout = (
        "LaViDa-Dream's LlavaDreamForMaskedDiffusion layout (Dream's model.layers.N.self_attn."
        "q_proj with biases, model.vision_tower.vision_tower.vision_model.*, "
        "model.mm_projector.{0,2}, model.image_newline, lm_head)"
    )

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.config = args
        self.model_type = args.model_type
        self.model = qwen2.Qwen2Model(args)  # Dream's body; read bidirectionally
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.vision = llava_llada.vision_module(args)
        self.__dict__["slots"] = SlotStore(NAME, args.vocab_size, llava_llada.MAX_STORED_FEATURES)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism as Dream's (mlx-lm's qwen2.Model.shard); the vision path stays
        replicated."""
        group = sharding.checked_group(self, group, NAME, "intermediate_size")
        qwen2.Model.shard(self, group)

    @cached_spec
    def diffusion_spec(self):
        return build_spec(
            self.args,
            FAMILY,
            PREFIX_DLM,
            "add it to config.json (151666, <|mask|>, for LaViDa-Dream).",
            logit_shift=1,
            confidence="sampled",
            quota_base="masks",
            samplers=("dream",) + SHARED_SAMPLERS,
            commit_rules=SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            generation_config_keys={"alg_temp": "alg_temp", "eps": "eps"},
            ignored_generation_config_keys=dream.IGNORED_GENERATION_CONFIG_KEYS,
            sampling_order=("temperature", "top_p", "top_k"),
            eos_token_names=("<|im_end|>",),
            sampler_defaults={"dream": {"block_length": None}},
            vocab_size=self.args.vocab_size,
            settings=SETTINGS,
            relations=(dream.ALG_RELATION,),
            likelihood=TIMESTEP_ELBO,
        )
