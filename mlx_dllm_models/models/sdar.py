"""SDAR (JetLM/SDAR-*-Chat) and TraDo: block-diffusion LMs with an exact Qwen3 body.

Only the attention pattern differs from Qwen3: blocks of `block_size` tokens, aligned on absolute
positions, attend bidirectionally inside the block and to every earlier block. The model never builds
that mask itself; the engine passes `mlx_dllm_models.masks.block_causal_mask` (or a cache-aware one).
Logits at position i predict token i (no shift).
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from mlx_lm.models import qwen3

from ..settings_families import Setting
from ..spec import SHARED_SAMPLERS, DiffusionSpec
from ..validators import number
from .common import cached_spec, check_special_ids, trained_blocks_spec
from .mlx_lm_body import MaskedBody

# The settings family of SDAR's specs (SDAR, SDAR-MoE), and the row it adds: generate.py's
# entropy_bounded remasking.
FAMILY = "sdar"
SETTINGS = (
    Setting(
        "eb_threshold",
        None,
        "SDAR: entropy budget of the entropy_bounded sampler (generate.py's eb_threshold)",
        float,
        number(0, low_open=True),
        samplers=("entropy_bounded",),
    ),
)

# The id SDAR/TraDo checkpoints use for <|MASK|>; their HF config.json does not carry it.
SDAR_MASK_TOKEN_ID = 151669
SDAR_BLOCK_SIZE = 4
# JetAstra/SDAR README: both engine examples (JetEngine `dynamic_threshold=0.9`, LMDeploy
# `dllm_confidence_threshold=0.9`, the latter greedy) decode low_confidence_dynamic at 0.9;
# generate.py's own default, 0.85, is a script default, not the model card's recipe.
SDAR_THRESHOLD = 0.9
# generate.py's `eb_threshold` default (remasking_strategy="entropy_bounded").
SDAR_EB_THRESHOLD = 0.35
# The special ids SDAR configs carry besides the mask id, checked against the vocabulary.
SDAR_SPECIAL_IDS = ("eos_token_id", "pad_token_id")
# What `check_weights` says to compare with the checkpoint.
SDAR_CONFIG_KEYS = (
    "num_hidden_layers, hidden_size, intermediate_size, head counts, head_dim, vocab_size"
)


def sdar_spec(args, defaults=None, **fields) -> DiffusionSpec:
    """SDAR's spec; a family on SDAR's body (SDAR-VL) gives its own `defaults` over these and
    further spec `fields`."""
    # generate.py: low_confidence_dynamic keeps tokens with probability > threshold (BLOCK_READING);
    # sample_with_temperature_topk_topp: temperature, then top-k, then top-p. Its
    # generation_config.json holds Qwen3's AR sampling defaults (temperature 0.6, top_k 20, top_p
    # 0.95) that SDAR's diffusion generate.py never reads.
    return trained_blocks_spec(
        args,
        FAMILY,
        int(args.block_size),
        settings=SETTINGS,
        # low_confidence_static = "quota", low_confidence_dynamic = "threshold", sequential,
        # entropy_bounded (its own rule: decoding.block.entropy_bounded_commit).
        samplers=SHARED_SAMPLERS + ("sequential", "entropy_bounded"),
        sampler_defaults={"entropy_bounded": {"eb_threshold": SDAR_EB_THRESHOLD}},
        defaults={
            # The reference splits a block over `denoising_steps`; README/TraDo use steps == block.
            # generate.py's `low_confidence_dynamic` = threshold with the per-step quota as fallback.
            "sampler": "threshold",
            "threshold": SDAR_THRESHOLD,
            # The reference samples at temperature 1.0 by default; greedy is the deterministic
            # default here (the README evaluates with greedy decoding).
            "temperature": 0.0,
            "max_tokens": 128,
            **(defaults or {}),
        },
        **fields,
    )


@dataclass
class ModelArgs(qwen3.ModelArgs):
    block_size: int = SDAR_BLOCK_SIZE
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        check_special_ids(self, SDAR_SPECIAL_IDS, mask_default=SDAR_MASK_TOKEN_ID)


class Model(MaskedBody, qwen3.Model):
    """SDARForCausalLM: mlx-lm's qwen3 read under the caller's mask."""

    family = "sdar"
    layout = "Qwen3's layout (e.g. 'model.layers.0.self_attn.q_norm.weight')"
    config_keys = SDAR_CONFIG_KEYS

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return sdar_spec(self.args)
