"""The options of LLaDA's `generate.py` (ML-GSAI/LLaDA) as pure rules: classifier-free guidance,
random remasking and the EOS / EoT suppressions of its Appendix B.4.

* cfg_scale: the unconditional input is the same sequence with every given token (the prompt, and
  a suffix when infilling) replaced by the mask token; the logits are
  uncond + (cfg_scale + 1) * (cond - uncond). Both rows run in one batched forward.
* remasking="random" (sampler "random"): the quota rule ranking candidates by a uniform draw
  instead of the confidence.
* logits_eos_inf: the EOS logit is -inf before anything else, so EOS is never proposed and its mass
  leaves the confidence.
* confidence_eos_eot_inf: after the proposal is drawn, the EoT logit is -inf in the softmax the
  confidence reads: a proposed EoT gets confidence 0 and the others are renormalised without EoT's
  mass. Upstream's line `logits_with_noise[:, :, EOS] = logits[:, :, EOT] = -inf` also touches EOS
  at temperature 0 only, where `add_gumbel_noise` returns `logits` itself; above 0 the EOS write
  lands in a fresh array that is never read again. Kept exactly so (`confidence_suppressed_ids`).
"""

from typing import Sequence, Tuple

import mlx.core as mx

from .rule import CommitRule, always
from .rules import quota_commit
from .stats import uniform as uniform_draws


def unconditional_tokens(x: mx.array, given: mx.array, mask_id: int) -> mx.array:
    """generate.py's `un_x`: the sequence with every given position (`given`, (B, L) bool: the
    prompt's tokens, padding excluded) replaced by the mask token. Positions generated so far keep
    their tokens, as upstream's `un_x = x.clone(); un_x[prompt_index] = mask_id` does."""
    return mx.where(given, mx.array(mask_id, dtype=x.dtype), x)


def guided_logits(cond: mx.array, uncond: mx.array, cfg_scale: float) -> mx.array:
    """Classifier-free guidance: uncond + (cfg_scale + 1) * (cond - uncond), in float32."""
    cond, uncond = cond.astype(mx.float32), uncond.astype(mx.float32)
    return uncond + (cfg_scale + 1.0) * (cond - uncond)


def confidence_suppressed_ids(
    eos_ids: Sequence[int], eot_id: int, temperature: float
) -> Tuple[int, ...]:
    """The ids confidence_eos_eot_inf takes out of the confidence's softmax, as generate.py's
    aliasing makes them: EoT always, EOS at temperature 0 only (see the module docstring)."""
    return (int(eot_id),) + (tuple(int(e) for e in eos_ids) if temperature == 0 else ())


def random_confidence(key: mx.array, shape) -> mx.array:
    """remasking="random": generate.py's `x0_p = torch.rand(b, l)`, a uniform draw per position."""
    return uniform_draws(key, shape)


def random_commit(stats, cand, ctx):
    """Sampler "random" (LLaDA remasking="random"): the schedule's quota of candidates, picked by a
    uniform draw from the step's key instead of by confidence."""
    return quota_commit(random_confidence(ctx.key, cand.shape), cand, ctx.floor)


# It commits exactly the schedule's floor: a step whose floor is 0 changes nothing.
random_commit = CommitRule(random_commit, exact_floor=always, draws=always)
