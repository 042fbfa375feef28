"""RND1-30B-A3B (radicalnumerics/RND1-Base-0910, model_type "rnd1"): a Qwen3-30B-A3B MoE body read
bidirectionally.

Reproduces `rnd/modeling_rnd.py` of RadicalNumerics/RND1 (`RND1LM`, the class the checkpoint's
auto_map names for AutoModelForMaskedLM): Qwen3-MoE's weights and layer math (q/k RMSNorm per
head, RoPE, a softmax router over `num_experts` with the top `num_experts_per_tok` renormalised when
`norm_topk_prob`, SwiGLU experts), attention with `is_causal=False` and no mask (its sampler never
passes one), an untied `lm_head`.

Its sampler reads position i's token from hidden state i-1 (`rnd/sampling.py`: "pos i predicts
token i+1"), as Dream's: the spec declares `logit_shift=1` and the engine applies it.

One difference in reading config.json: the repository's latest `RND1Config` overwrites whatever
config.json says with its CONFIG_DEFAULTS (those of the released checkpoint); here config.json is
read as it is, as mlx-lm reads every model, so that other sizes (the tests' fixtures) load.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from mlx_lm.models import qwen3_moe

from ..decoding.rnd1 import rnd1_commit
from ..settings_families import Setting
from ..spec import SHARED_SAMPLERS
from ..validators import cli_optional_float, number, optional
from .common import (
    check_special_ids,
)
from .dream import DREAM_READING
from .mlx_lm_body import MaskedBody

# The settings family of RND1's spec, and the row it adds: sampling.py's entropy-bounded variant of
# its sampler.
FAMILY = "rnd1"
# Its sampler: sampling.py's diffusion_sample (decoding/rnd1.py).
SAMPLERS = {"rnd1": rnd1_commit}
SETTINGS = (
    Setting(
        "eb_gamma",
        None,
        "RND1: entropy budget of the rnd1 sampler's entropy-bounded variant (sampling.py's "
        "eb_gamma; none: the reference's quota schedule)",
        cli_optional_float,
        optional(number(0, what=" (nats)")),
        samplers=("rnd1",),
    ),
)

# RND1Config's default mask id (rnd/configuration_rnd.py); the Qwen3 tokenizer has no token there.
RND1_MASK_TOKEN_ID = 151669
# generation_utils.py's fallback pad id (<|endoftext|>) when config.json names none.
RND1_PAD_TOKEN_ID = 151643

# The recipe of RND1's README (Python API) and demo_rnd_generation.py's defaults:
# generate(max_new_tokens=256, num_diffusion_steps=256, temperature=0.01), no top-k / top-p,
# greedy=False (RND1GenerationConfig's default: the proposals are sampled at that temperature).
# The steps stay 256 whatever max_tokens is, as in the reference's generate (RND1GenerationConfig
# always carries num_diffusion_steps); steps that commit nothing cost no forward here.
REFERENCE_DEFAULTS = {
    "sampler": "rnd1",
    "temperature": 0.01,
    "top_p": None,
    "top_k": None,
    "max_tokens": 256,
}
REFERENCE_STEPS = 256
# The reference's generate builds a fresh RND1GenerationConfig from its arguments and never reads
# the checkpoint's generation_config.json: none of its keys is read here either.
IGNORED_GENERATION_CONFIG_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k")


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    # rnd/configuration_rnd.py: the default of the reference's generate (which never reads it).
    num_diffusion_steps: int = REFERENCE_STEPS

    def __post_init__(self):
        # RND1Config's defaults write `rope_scaling: false` (meaning none); qwen3_moe's RoPE
        # takes no scaling.
        if self.rope_scaling is False:
            self.rope_scaling = None
        check_special_ids(self, mask_default=RND1_MASK_TOKEN_ID)


class Model(MaskedBody, qwen3_moe.Model):
    """RND1LM: mlx-lm's qwen3_moe read under the caller's mask (None: every position sees every
    other)."""

    family = "rnd1"
    layout = "Qwen3-MoE's layout (e.g. 'model.layers.0.mlp.experts.0.gate_proj.weight')"
    config_keys = (
        "num_hidden_layers, hidden_size, head counts, head_dim, num_experts, "
        "moe_intermediate_size, vocab_size"
    )
    shard_widths = ("moe_intermediate_size", "intermediate_size")

    spec_family = FAMILY

    def spec_fields(self) -> dict:
        return dict(
            settings=SETTINGS,
            **DREAM_READING,
            # "rnd1" is rnd/sampling.py's diffusion_sample (decoding/rnd1.py); the shared
            # samplers run block-wise.
            samplers=("rnd1",) + SHARED_SAMPLERS,
            commit_rules=SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            ignored_generation_config_keys=IGNORED_GENERATION_CONFIG_KEYS,
            # forward_scores: logits / temperature, then top-k, then top-p.
            sampling_order=("temperature", "top_k", "top_p"),
            # The whole canvas is one block, over the reference's 256 steps (the shared
            # samplers keep their steps = block_length).
            sampler_defaults={"rnd1": {"block_length": None, "steps": REFERENCE_STEPS}},
            vocab_size=self.args.vocab_size,
            # RND1GenerationMixin.generate always sets an EOS id, so diffusion_sample keeps the
            # last of its max_new_tokens positions as the pad token (never a mask): the model
            # sees it after the canvas at every step. The engine's canvas is max_tokens - 1
            # masks, then this pad. A pad id of 0 is an id (the fallback is for none).
            default_suffix=(
                RND1_PAD_TOKEN_ID if self.args.pad_token_id is None else self.args.pad_token_id,
            ),
        )
