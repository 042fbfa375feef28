"""dllm's masked-diffusion samplers (ZHZisZZ/dllm, dllm/core/samplers): the per-step quota schedule
of `get_num_transfer_tokens` (samplers/utils.py) under its default LinearAlphaScheduler, and the
low_confidence remasking of MDLMSampler (samplers/mdlm.py) and BD3LMSampler (samplers/bd3lm.py):
the `mdlm` and `bd3lm` samplers (one rule; what differs is the attention, which the family's spec
says).

The schedule differs from LLaDA's (decoding.schedule.transfer_schedule, an even split with the
remainder first): each step takes round(remaining x (1 - (1 - alpha(s)) / (1 - alpha(t)))) of the
masks left, t = (steps - j) / steps and s = t - 1 / steps, so with alpha(t) = 1 - t a step takes
round(remaining / (steps - j)); the ratio is computed in float32 as the scheduler does, the product
in float64 and rounded half to even (torch.round). Steps that take nothing are dropped
(the model is not conditioned on time), so a row's schedule is its non-zero quotas in order.
"""

from typing import List

import mlx.core as mx
import numpy as np

from .rule import CommitRule, always
from .rules import quota_commit


def linear_alpha_quotas(masks: int, steps: int) -> List[int]:
    """One row's quotas: get_num_transfer_tokens(stochastic=False) under LinearAlphaScheduler,
    with the zero steps dropped."""
    left, out = int(masks), []
    one = np.float32(1.0)
    for j in range(steps):
        if left == 0:
            break
        t = np.float32((steps - j) / steps)
        s = np.float32((steps - j - 1) / steps)
        # reverse_mask_prob: (1 - alpha(s)) / (1 - alpha(t)) in float32, alpha(i) = 1 - i.
        ratio = (one - (one - s)) / (one - (one - t))
        k = int(np.round(np.float64(left) * (1.0 - float(ratio))))
        k = min(k, left)
        left -= k
        if k > 0:
            out.append(k)
    return out


def dllm_schedule(masks: mx.array, steps: int, settings=None) -> mx.array:
    """(B, K) int32: each row's non-zero quotas from the block's first step, zeros after (K at
    least 1). Rows of a batch keep their own single-run schedules."""
    rows = [linear_alpha_quotas(m, steps) for m in masks.tolist()]
    width = max([len(r) for r in rows] + [1])
    return mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)


def dllm_commit(stats, cand, ctx):
    """Samplers "mdlm" / "bd3lm" (remasking="low_confidence"): the schedule's quota of the block's
    most confident masks, ranked by F.softmax(logits) at x0 as the samplers compute it (torch's
    form keeps apart the masks within 1e-6 of certain that exp(logit - logsumexp) makes equal)."""
    return quota_commit(stats.raw_softmax_confidence, cand, ctx.floor)


# It commits exactly the schedule's floor: a step whose floor is 0 changes nothing.
dllm_commit = CommitRule(
    dllm_commit,
    schedule=dllm_schedule,
    exact_floor=always,
    stats_extras=("raw_softmax_confidence",),
)
