"""The resolved settings: a frozen dataclass with a field per row of the settings table, in its
order, typed by the row's flag (settings_record.SettingsRecord: which of them a family has, and
as_dict). Generated from settings.SETTINGS; do not edit, rewrite it with
python -m mlx_dllm_models.settings_index --write
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from .settings_record import SettingsRecord


@dataclass(frozen=True)
class ResolvedSettings(SettingsRecord):
    max_tokens: int = 128
    """new tokens at most (EOS may end earlier)"""
    block_length: int = 32
    """positions per block"""
    steps: Optional[int] = None
    """denoising steps per block (default: block_length)"""
    sampler: str = "quota"
    """quota | threshold | factor | entropy (a family may add its own)"""
    threshold: float = 0.9
    """confidence threshold of the threshold sampler, in (0, 1] (d3llm: entropy bound, nats)"""
    factor: float = 1.0
    """factor of the factor sampler (Fast-dLLM)"""
    entropy_bound: float = 0.1
    """entropy budget of the entropy sampler (EB-Sampler), in nats"""
    temperature: float = 0.0
    """sampling temperature; 0 is greedy"""
    top_p: Optional[float] = None
    """nucleus filtering"""
    top_k: Optional[int] = None
    """top-k filtering"""
    seed: int = 0
    """PRNG seed"""
    logprobs: Optional[int] = None
    """report each token's log-probability and this many alternatives (0-20)"""
    cache: str = "auto"
    """auto | none | a cache the family's attention layout offers"""
    cfg_scale: Optional[float] = None
    """LLaDA: classifier-free guidance scale (0: off); the unconditional row masks the prompt"""
    logits_eos_inf: Optional[bool] = None
    """LLaDA: never propose EOS (its logit is -inf), as generate.py's logits_eos_inf"""
    confidence_eos_eot_inf: Optional[bool] = None
    """LLaDA: a proposed end-of-turn token gets confidence 0, as generate.py's
    confidence_eos_eot_inf"""
    schedule: Optional[str] = None
    """LaViDa (sampler 'lavida'): shift | linear, the noise schedule the step quotas follow"""
    schedule_shift: Optional[float] = None
    """LaViDa: the shift of schedule 'shift' (default 3; run_coco.sh uses 0.33)"""
    block_size: Optional[int] = None
    """d3LLM: positions per block of its pipeline"""
    block_add_threshold: Optional[float] = None
    """d3LLM: open a block at this share of the last decoded"""
    decoded_token_threshold: Optional[float] = None
    """d3LLM: fully active once the block before is this share decoded"""
    early_stop: Optional[bool] = None
    """d3LLM: positions after a decoded EOS become EOS"""
    alg: Optional[str] = None
    """Dream: origin | maskgit_plus | topk_margin | entropy (sampler 'dimple': origin |
    origin-ratio | autoregressive | maskgit_plus | entropy)"""
    alg_temp: Optional[float] = None
    """Dream: temperature of the confidence ranking (0 or none ranks greedily)"""
    eps: Optional[float] = None
    """Dream: the last timestep of its schedule, in (0, 1)"""
    alg_p_threshold: Optional[float] = None
    """Dimple: confident decoding, commit every mask whose probability exceeds it (0 or none:
    off)"""
    eb_threshold: Optional[float] = None
    """SDAR: entropy budget of the entropy_bounded sampler (generate.py's eb_threshold)"""
    editing_mode: Optional[str] = None
    """LLaDA2: quality | speed (the LLaDA2.1 model card's Quality / Speed Mode: threshold and
    editing_threshold) | off (2.0's generate, no editing); default: quality for 2.1, speed
    for 2.2 (its generate's; DELETE / SPLIT edits on), off for 2.0"""
    editing_threshold: Optional[float] = None
    """LLaDA2.1: rewrite a committed token when another is proposed above this probability
    (none: editing off)"""
    max_post_steps: Optional[int] = None
    """LLaDA2.1: editing forwards after a block has no masks left"""
    sub_block_length: Optional[int] = None
    """Fast-dLLM v2: positions per sub-block of the sub_block sampler (divides block_length)"""
    mode: Optional[str] = None
    """Nemotron: diffusion | self_spec (lossless self-speculation)"""
    draft_threshold: Optional[float] = None
    """Nemotron self_spec: linear_spec_generate's threshold: drafts over several forwards,
    each revealing the masks whose confidence reaches it (none: one draft forward)"""
    causal_context: Optional[bool] = None
    """Nemotron: true: the context (prompt, finished blocks) is causal and the AR head seeds
    each block; false: the prompt and each finished block attend bidirectionally within
    themselves and to what precedes them, and blocks start as masks"""
    max_thinking_tokens: Optional[int] = None
    """Nemotron: thinking budget: a row that has not produced end_think_token_id within this
    many new tokens gets it at that position (with end_think_token_id)"""
    end_think_token_id: Optional[int] = None
    """Nemotron: the token that ends thinking (e.g. the id of </think>), forced at
    max_thinking_tokens"""
    max_denoising_steps: Optional[int] = None
    """DiffusionGemma: denoising steps per canvas at most"""
    t_min: Optional[float] = None
    """DiffusionGemma: temperature of the last step"""
    t_max: Optional[float] = None
    """DiffusionGemma: temperature of the first step"""
    stability_threshold: Optional[int] = None
    """DiffusionGemma: steps the argmax must stay unchanged to stop a canvas"""
    confidence_threshold: Optional[float] = None
    """DiffusionGemma: mean entropy below which a stable canvas stops"""
    min_canvas_length: Optional[int] = None
    """DiffusionGemma: shortest last canvas (default: the trained canvas length, as
    transformers; lower it to shorten the last canvas to the tokens still wanted)"""
    max_canvas_length: Optional[int] = None
    """DiffusionGemma: longest canvas (the trained length)"""
    eb_gamma: Optional[float] = None
    """RND1: entropy budget of the rnd1 sampler's entropy-bounded variant (sampling.py's
    eb_gamma; none: the reference's quota schedule)"""
    entropy_threshold: Optional[float] = None
    """WeDLM: fill every mask whose entropy plus the position penalty is below this, at least
    one (wedlm_entropy_threshold; 0: one mask a step, the least, as the reference's None)"""
    pos_penalty_factor: Optional[float] = None
    """WeDLM: added to a mask's entropy per position after the window's first mask
    (wedlm_pos_penalty_factor)"""
    noise_schedule: Optional[str] = None
    """GIDD: the noise schedule of a block's steps (alpha from 1 - t or cos)"""
    tokens_per_step: Optional[int] = None
    """GIDD: positions the adaptive sampler changes per step"""
    present: Tuple[str, ...] = ()
    """The settings the family has, in resolution order (SettingsRecord)."""
