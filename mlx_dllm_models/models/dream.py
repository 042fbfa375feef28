"""Dream 7B (Dream-org/Dream-v0-Base-7B, Dream-v0-Instruct-7B): a Qwen2.5 body read bidirectionally.

Reproduces the Hugging Face remote code `modeling_dream.py` (copies in NVlabs/Fast-dLLM `dream/model/`
and ZHZisZZ/dllm `dllm/pipelines/dream/models/`): Qwen2 weights and layer math, attention with
`is_causal=False`, padding expressed as a boolean keep-mask plus explicit positions.

Dream predicts token i from hidden state i-1 (its generator shifts the logits right by one). The model
returns unshifted logits; the spec declares `logit_shift=1` and the engine applies it, once, by choosing
which hidden rows feed the head. `shift_logits` is the reference form of that shift, for tests.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models import qwen2

from ..decoding.dream import dream_commit
from ..settings_families import D3LLM_DEFAULTS, D3LLM_SETTINGS, Relation, Setting
from ..spec import SHARED_SAMPLERS, TIMESTEP_ELBO
from ..validators import choice, cli_optional_float, number, optional
from .common import (
    check_special_ids,
)
from .mlx_lm_body import MaskedBody

# The settings family this module's spec belongs to (the settings table groups rows by it).
FAMILY = "dream"
# The sampler this family owns: diffusion_generate (decoding/dream.py), which the families that
# adapt it (CoDA, Open-dCoder, LaViDa-Dream, Dimple) take from here.
SAMPLERS = {"dream": dream_commit}

# Dream's algorithms (decoding/dream.py) and those only Dimple's "dim" pipeline has
# (decoding/dimple.py, which has no topk_margin).
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
DIMPLE_ONLY_ALGS = ("origin-ratio", "autoregressive")

# Dream's diffusion_generate, read by the "dream" sampler (CoDA's and Open-dCoder's adaptations of
# it take the same rows) and by Dimple's "dim" pipeline (sampler "dimple").
ALG = Setting(
    "alg",
    None,
    "Dream: origin | maskgit_plus | topk_margin | entropy (sampler 'dimple': origin | "
    "origin-ratio | autoregressive | maskgit_plus | entropy)",
    str,
    choice(DREAM_ALGS + DIMPLE_ONLY_ALGS, " for sampler 'dream' or 'dimple'"),
    samplers=("dream", "dimple"),
)
ALG_TEMP = Setting(
    "alg_temp",
    None,
    "Dream: temperature of the confidence ranking (0 or none ranks greedily)",
    cli_optional_float,
    optional(number(0, what=" (0 or null ranks greedily)")),
    samplers=("dream", "dimple"),
)
EPS = Setting(
    "eps",
    None,
    "Dream: the last timestep of its schedule, in (0, 1)",
    float,
    number(0, 1, low_open=True, high_open=True, what=" (the last timestep of Dream's schedule)"),
    samplers=("dream", "dimple"),
)
DIFFUSION_GENERATE_SETTINGS = (ALG, ALG_TEMP, EPS)
# The alg each pipeline takes: Dimple's has no topk_margin, Dream's none of Dimple's own.
ALG_RELATION = Relation(
    "alg",
    "sampler",
    lambda alg, sampler: (
        alg != "topk_margin" if sampler == "dimple" else alg not in DIMPLE_ONLY_ALGS
    ),
    "alg {alg!r} does not decode with sampler {sampler!r}: sampler 'dimple' takes origin, "
    "origin-ratio, autoregressive, maskgit_plus or entropy; 'dream' takes origin, "
    "maskgit_plus, topk_margin or entropy",
)
# Dimple's "dim" pipeline (yu-rp/Dimple generation_utils.py): its confident decoding. A row of the
# dream settings family, whose Dimple checkpoints list the sampler.
ALG_P_THRESHOLD = Setting(
    "alg_p_threshold",
    None,
    "Dimple: confident decoding, commit every mask whose probability exceeds it (0 or none: off)",
    cli_optional_float,
    optional(number(0, 1, what=" (0 or null: off)")),
    samplers=("dimple",),
)
# The dream settings family's rows (Dream, DiffuCoder, Dimple, LaViDa-Dream).
SETTINGS = DIFFUSION_GENERATE_SETTINGS + (ALG_P_THRESHOLD,) + D3LLM_SETTINGS

# The recipe of Dream's README (DreamLM/Dream, Dream-v0-Instruct-7B usage example and model card):
# diffusion_generate(max_new_tokens=512, steps=512, temperature=0.2, top_p=0.95, alg="entropy",
# alg_temp=0.), i.e. steps = the number of new tokens, one token per step. steps stays unset here,
# so that it follows max_tokens (the "dream" sampler's block is the whole canvas, and steps
# default to the block's length, settings.resolve_settings); max_tokens keeps the package-wide
# 128. Dream's schedule commits int(m * (1 - s/t)) tokens a step, 0 on some steps: the engine
# skips those without a forward, so a request of N tokens costs at most N forwards.
REFERENCE_DEFAULTS = {
    "sampler": "dream",
    "alg": "entropy",
    "alg_temp": 0.0,
    "eps": 1e-3,
    "temperature": 0.2,
    "top_p": 0.95,
    "top_k": None,
    "max_tokens": 128,
}
# Dream-v0-*-7B's generation_config.json is DreamGenerationConfig with its class defaults
# (alg "origin", steps 512, temperature 0.0, top_p null): not a recipe (the README's calls pass
# their own), and steps 512 whatever max_tokens is would cost 512 forwards for 16 tokens with
# "origin". These keys are not read from it; eps and alg_temp are.
IGNORED_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k")
# d3LLM's recipe for d3LLM_Dream / d3LLM_Dream_Coder (chat/chat_d3llm_dream.py), with no top-p /
# top-k (its _sample_multi_block reads neither).
D3LLM_DREAM_DEFAULTS = {**D3LLM_DEFAULTS, "top_p": None, "top_k": None}


# How diffusion_generate reads the logits, shared by the families built on it (CoDA, Open-dCoder,
# RND1): token i from hidden state i-1, the sampled token's probability as its confidence, the
# step quotas over the masks left.
DREAM_READING = dict(logit_shift=1, confidence="sampled", quota_base="masks")


@dataclass
class ModelArgs(qwen2.ModelArgs):
    # Dream's config says false; Qwen2's dataclass defaults to tied.
    tie_word_embeddings: bool = False
    head_dim: Optional[int] = None
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        # Dream's attention (like mlx-lm's Qwen2) derives head_dim from hidden_size / heads.
        if (
            self.head_dim is not None
            and self.head_dim * self.num_attention_heads != self.hidden_size
        ):
            raise ValueError(
                f"config.json: head_dim={self.head_dim} but hidden_size / num_attention_heads = "
                f"{self.hidden_size} / {self.num_attention_heads}; Dream requires them to agree."
            )
        # A missing mask id is an error only when decoding asks for it (diffusion_spec).
        check_special_ids(self, mask_absent=(None,))


def shift_logits(logits: mx.array) -> mx.array:
    """Dream's logit alignment, `cat([logits[:, :1], logits[:, :-1]], dim=1)` in `_sample`:
    position i takes the logits of position i-1; position 0 keeps its own."""
    return mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


class Model(MaskedBody, qwen2.Model):
    """Dream's model: mlx-lm's Qwen2 (q/k/v biases) read under the caller's mask."""

    family = "dream"
    # q/k/v biases are what tells a Qwen2 (Dream) checkpoint from a Llama-like one.
    layout = "Qwen2's layout, with q/k/v biases (e.g. 'model.layers.0.self_attn.k_proj.bias')"
    config_keys = "num_hidden_layers, hidden_size, intermediate_size, head counts, vocab_size"

    spec_family = FAMILY
    missing_mask = "add it to config.json (151666, <|mask|>, for Dream-v0-*-7B)."

    def spec_fields(self) -> dict:
        return dict(
            settings=SETTINGS,
            relations=(ALG_RELATION,),
            likelihood=TIMESTEP_ELBO,
            **DREAM_READING,
            # "dream" is diffusion_generate (its `alg` picks origin / maskgit_plus / topk_margin /
            # entropy); the shared samplers run block-wise, as Fast-dLLM's Dream path does.
            samplers=("dream", "d3llm") + SHARED_SAMPLERS,
            commit_rules=SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            generation_config_keys={"alg_temp": "alg_temp", "eps": "eps"},
            ignored_generation_config_keys=IGNORED_GENERATION_CONFIG_KEYS,
            sampling_order=("temperature", "top_p", "top_k"),  # Dream's sample_tokens
            # DiffuCoder (apple/DiffuCoder-7B-*, Dream's model_type and code): its instruct models
            # pad the canvas with <|dlm_pad|> after <|im_end|>, and its README's answer is the text
            # before the first one (generations[0].split('<|dlm_pad|>')[0]).
            eos_token_names=("<|dlm_pad|>",),
            # The whole canvas is one block ("d3llm": d3LLM's multi-block decoding, decoding/d3llm).
            sampler_defaults={"dream": {"block_length": None}, "d3llm": dict(D3LLM_DREAM_DEFAULTS)},
        )
