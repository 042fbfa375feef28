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
    # new tokens at most (EOS may end earlier)
    max_tokens: int = 128
    # positions per block
    block_length: int = 32
    # denoising steps per block (default: block_length)
    steps: Optional[int] = None
    # quota | threshold | factor | entropy (a family may add its own)
    sampler: str = "quota"
    # confidence threshold of the threshold sampler, in (0, 1] (d3llm: entropy bound, nats)
    threshold: float = 0.9
    # factor of the factor sampler (Fast-dLLM)
    factor: float = 1.0
    # entropy budget of the entropy sampler (EB-Sampler), in nats
    entropy_bound: float = 0.1
    # sampling temperature; 0 is greedy
    temperature: float = 0.0
    # nucleus filtering
    top_p: Optional[float] = None
    # top-k filtering
    top_k: Optional[int] = None
    # PRNG seed
    seed: int = 0
    # report each token's log-probability and this many alternatives (0-20)
    logprobs: Optional[int] = None
    # auto | none | a cache the family's attention layout offers
    cache: str = "auto"
    # LLaDA: classifier-free guidance scale (0: off); the unconditional row masks the prompt
    cfg_scale: Optional[float] = None
    # LLaDA: never propose EOS (its logit is -inf), as generate.py's logits_eos_inf
    logits_eos_inf: Optional[bool] = None
    # LLaDA: a proposed end-of-turn token gets confidence 0, as generate.py's confidence_eos_eot_inf
    confidence_eos_eot_inf: Optional[bool] = None
    # LaViDa (sampler 'lavida'): shift | linear, the noise schedule the step quotas follow
    schedule: Optional[str] = None
    # LaViDa: the shift of schedule 'shift' (default 3; run_coco.sh uses 0.33)
    schedule_shift: Optional[float] = None
    # d3LLM: positions per block of its pipeline
    block_size: Optional[int] = None
    # d3LLM: open a block at this share of the last decoded
    block_add_threshold: Optional[float] = None
    # d3LLM: fully active once the block before is this share decoded
    decoded_token_threshold: Optional[float] = None
    # d3LLM: positions after a decoded EOS become EOS
    early_stop: Optional[bool] = None
    # Dream: origin | maskgit_plus | topk_margin | entropy (sampler 'dimple': origin | origin-ratio
    # | autoregressive | maskgit_plus | entropy)
    alg: Optional[str] = None
    # Dream: temperature of the confidence ranking (0 or none ranks greedily)
    alg_temp: Optional[float] = None
    # Dream: the last timestep of its schedule, in (0, 1)
    eps: Optional[float] = None
    # Dimple: confident decoding, commit every mask whose probability exceeds it (0 or none: off)
    alg_p_threshold: Optional[float] = None
    # SDAR: entropy budget of the entropy_bounded sampler (generate.py's eb_threshold)
    eb_threshold: Optional[float] = None
    # LLaDA2: quality | speed (the LLaDA2.1 model card's Quality / Speed Mode: threshold and
    # editing_threshold) | off (2.0's generate, no editing); default: quality for 2.1, speed for 2.2
    # (its generate's; DELETE / SPLIT edits on), off for 2.0
    editing_mode: Optional[str] = None
    # LLaDA2.1: rewrite a committed token when another is proposed above this probability (none:
    # editing off)
    editing_threshold: Optional[float] = None
    # LLaDA2.1: editing forwards after a block has no masks left
    max_post_steps: Optional[int] = None
    # Fast-dLLM v2: positions per sub-block of the sub_block sampler (divides block_length)
    sub_block_length: Optional[int] = None
    # Nemotron: diffusion | self_spec (lossless self-speculation)
    mode: Optional[str] = None
    # Nemotron self_spec: linear_spec_generate's threshold: drafts over several forwards, each
    # revealing the masks whose confidence reaches it (none: one draft forward)
    draft_threshold: Optional[float] = None
    # Nemotron: true: the context (prompt, finished blocks) is causal and the AR head seeds each
    # block; false: the prompt and each finished block attend bidirectionally within themselves and
    # to what precedes them, and blocks start as masks
    causal_context: Optional[bool] = None
    # Nemotron: thinking budget: a row that has not produced end_think_token_id within this many new
    # tokens gets it at that position (with end_think_token_id)
    max_thinking_tokens: Optional[int] = None
    # Nemotron: the token that ends thinking (e.g. the id of </think>), forced at
    # max_thinking_tokens
    end_think_token_id: Optional[int] = None
    # DiffusionGemma: denoising steps per canvas at most
    max_denoising_steps: Optional[int] = None
    # DiffusionGemma: temperature of the last step
    t_min: Optional[float] = None
    # DiffusionGemma: temperature of the first step
    t_max: Optional[float] = None
    # DiffusionGemma: steps the argmax must stay unchanged to stop a canvas
    stability_threshold: Optional[int] = None
    # DiffusionGemma: mean entropy below which a stable canvas stops
    confidence_threshold: Optional[float] = None
    # DiffusionGemma: shortest last canvas (default: the trained canvas length, as transformers;
    # lower it to shorten the last canvas to the tokens still wanted)
    min_canvas_length: Optional[int] = None
    # DiffusionGemma: longest canvas (the trained length)
    max_canvas_length: Optional[int] = None
    # RND1: entropy budget of the rnd1 sampler's entropy-bounded variant (sampling.py's eb_gamma;
    # none: the reference's quota schedule)
    eb_gamma: Optional[float] = None
    # WeDLM: fill every mask whose entropy plus the position penalty is below this, at least one
    # (wedlm_entropy_threshold; 0: one mask a step, the least, as the reference's None)
    entropy_threshold: Optional[float] = None
    # WeDLM: added to a mask's entropy per position after the window's first mask
    # (wedlm_pos_penalty_factor)
    pos_penalty_factor: Optional[float] = None
    # GIDD: the noise schedule of a block's steps (alpha from 1 - t or cos)
    noise_schedule: Optional[str] = None
    # GIDD: positions the adaptive sampler changes per step
    tokens_per_step: Optional[int] = None
    # The settings the family has, in resolution order (SettingsRecord).
    present: Tuple[str, ...] = ()
