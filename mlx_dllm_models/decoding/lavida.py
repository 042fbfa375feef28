"""LaViDa's step schedules (jacklishufan/LaViDa `llava/model/language_model/llada/generate.py`,
`get_num_transfer_tokens_sch`): the `lavida` sampler, LLaDA's low_confidence commit of a per-step
quota that follows a noise schedule instead of an even split. predict.py's timed call and
eval/run_coco.sh (the README's "50% NFE" rows) use schedule="shift" with half the steps.

For a block with m masks and n steps (n capped at m), sigma(t) at t = 0, 1/n, ..., 1 is the
`schedule` (shift: shift * t / (1 + (shift - 1) * t); linear: t), in float32 as the reference
computes it (torch.linspace's float32 points, each end's half from its own end in one rounding,
then the float32 arithmetic of its expression; the reference's cosine and logit_normal are left
out: its cosine_schedule returns a numpy array that the next line calls `.to` on, and its
logit_normal's float32 erf is torch's own); each step's quota is the difference of
floor(sigma * m) at its ends, at least 1; the excess over m is taken back one token at a time,
cycling over the steps whose quota is above 1; then the order is reversed (the reference's
`.flip(-1)`), so the quota that sigma gives the last interval is spent first.
"""

from typing import List

import mlx.core as mx
import numpy as np

from .rule import CommitRule, always
from .rules import quota_commit

SCHEDULES = ("shift", "linear")
_F = np.float32


def linspace(n: int) -> np.ndarray:
    """torch.linspace(0, 1, n + 1) in float32: step = 1 / n in float32; the first half start +
    step * i, the second end - step * (n - i), each rounded once (its vectorized kernel's fused
    multiply-add)."""
    step = np.float64(_F(1) / _F(n))
    half = (n + 1) // 2
    return np.array(
        [_F(step * i) if i < half else _F(1.0 - step * (n - i)) for i in range(n + 1)],
        dtype=np.float32,
    )


def sigmas(schedule: str, steps: int, shift: float) -> np.ndarray:
    """The schedule at t = linspace(0, 1, steps + 1), float32 as torch computes it (Python's
    shift - 1 rounded to float32 once)."""
    t = linspace(steps)
    if schedule == "shift":
        return _F(shift) * t / (_F(1) + _F(shift - 1) * t)
    return t


def lavida_quotas(masks: int, steps: int, schedule: str, shift: float) -> List[int]:
    """One row's quotas, in the order they are spent."""
    masks = int(masks)
    if masks == 0:
        return []
    steps = min(steps, masks)
    counts = (sigmas(schedule, steps, shift) * _F(masks)).astype(np.int64)
    quota = np.maximum(counts[1:] - counts[:-1], 1)
    excess, j = int(quota.sum()) - masks, 0
    if excess < 0:  # sigma(1) * m rounded below m (the reference asserts it never is): ours
        quota[-1] -= excess
    while excess > 0:
        j %= len(quota)
        if quota[j] > 1:
            quota[j] -= 1
            excess -= 1
        j += 1
    return quota[::-1].tolist()


def lavida_schedule(masks: mx.array, steps: int, settings) -> mx.array:
    """(B, K) int32 floors: each row's quotas, zeros after."""
    schedule, shift = settings.schedule or "shift", settings.schedule_shift
    shift = 3.0 if shift is None else shift  # the reference's schedule_kwargs default
    rows = [lavida_quotas(m, steps, schedule, shift) for m in masks.tolist()]
    width = max([len(r) for r in rows] + [1])
    return mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)


def lavida_commit(stats, cand, ctx):
    """Sampler "lavida" (remasking="low_confidence" with a schedule): the step's quota of the
    block's most confident masks."""
    return quota_commit(stats.confidence, cand, ctx.floor)


lavida_commit = CommitRule(lavida_commit, schedule=lavida_schedule, exact_floor=always)
