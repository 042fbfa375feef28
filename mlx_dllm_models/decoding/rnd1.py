"""RND1's sampler, `diffusion_sample` of rnd/sampling.py (RadicalNumerics/RND1), as a commit rule and
a schedule for the masked block engine. Selected with sampler="rnd1".

The reference decodes the whole canvas as one block of M masks over T = num_diffusion_steps
forwards. After the forward of step k (k = 0 .. T-2) it keeps masked the floor(M * (T-1-k) / T)
masks of highest entropy and commits every other one (torch computes the product in float32:
`(total_masked * rate).long()`); the last forward commits what is left. The entropy is that of the
distribution the proposals are drawn from: log_softmax of logits / temperature, then top-k, then
top-p. So a step commits its quota of lowest-entropy masks, which is the quota rule on -entropy.

Deviations, each where the reference's outcome is not defined by its arithmetic:
* Temperature 0. The reference divides by max(temperature, 1e-8): every entropy underflows to 0
  and which masks a step keeps is whatever order torch.topk returns among equal values. Here, at
  temperature 0, the ranking reads the entropy of the unscaled (top-k / top-p filtered)
  distribution: the reference's own computation with greedy=True at temperature 1.
* Ties (equal entropies, common at small temperatures) commit the leftmost masks first.
* With top-k or top-p the reference's entropy is NaN (0 * log 0 over the filtered tokens); here
  the filtered tokens contribute nothing.

With the `eb_gamma` setting (the entropy-bounded variant the repository added in its PR #8) a step
has no quota: the masks, most confident first (confidence: the proposal's probability), are
committed while the sum of their entropies less the largest of them stays within eb_gamma (at
least one); the last step commits what is left.
"""

import mlx.core as mx
import numpy as np

from ..errors import SettingsError
from .rule import CommitRule
from .rules import quota_commit

# The schedule is a loop over the steps; beyond this many it is refused.
MAX_SCHEDULED_STEPS = 1 << 20


def kept_masked(masks: np.ndarray, steps: int) -> np.ndarray:
    """(B, steps) int64: the masks each row still holds after each forward, as the reference
    computes them: floor(float32(M) * float32(step / T)) for step = T-1 .. 1, then 0."""
    m = np.asarray(masks, np.int64)
    rates = np.array([s / steps for s in range(steps - 1, 0, -1)], np.float64).astype(np.float32)
    kept = np.floor(m[:, None].astype(np.float32) * rates[None, :]).astype(np.int64)
    kept = np.maximum(kept, 0)
    return np.concatenate([kept, np.zeros((m.shape[0], 1), np.int64)], axis=1)


def rnd1_schedule(masks: mx.array, steps: int, settings) -> mx.array:
    """(B, K) int32 commit counts of the first K <= steps steps of RND1's schedule (later steps
    commit nothing), each row summing to its mask count. With eb_gamma: nothing before the last
    step, which commits what is left."""
    if steps > MAX_SCHEDULED_STEPS:
        raise SettingsError(
            f"steps={steps}: RND1's schedule is computed step by step; use steps <= "
            f"{MAX_SCHEDULED_STEPS} (steps beyond the number of masks commit nothing anyway)"
        )
    m = np.array(masks, dtype=np.int64)
    if settings.eb_gamma is not None:
        out = np.zeros((m.shape[0], steps), np.int32)
        out[:, -1] = m
        return mx.array(out)
    kept = kept_masked(m, steps)
    before = np.concatenate([m[:, None], kept[:, :-1]], axis=1)
    counts = before - kept
    used = np.nonzero(counts.any(axis=0))[0]
    width = int(used[-1]) + 1 if used.size else 1
    return mx.array(counts[:, :width].astype(np.int32))


def entropy_bounded(confidence, entropy, cand, gamma: float) -> mx.array:
    """The candidates, most confident first, while sum(H) - max(H) over them stays <= gamma
    (sampling.py's eb_gamma criterion; the first always passes)."""
    order = mx.argsort(-mx.where(cand, confidence, -mx.inf), axis=-1)
    h = mx.take_along_axis(mx.where(cand, entropy, 0.0), order, axis=-1)
    excess = mx.cumsum(h, axis=-1) - mx.cummax(h, axis=-1)
    ok = mx.take_along_axis(excess <= gamma, mx.argsort(order, axis=-1), axis=-1)
    return ok & cand


def rnd1_commit(stats, cand, ctx):
    """Commit rule of sampler "rnd1": the step's quota (rnd1_schedule's) of lowest-entropy masks;
    with eb_gamma, the entropy-bounded set (and at the last step, whose quota is every mask left,
    the rest)."""
    gamma = ctx.settings.eb_gamma
    if gamma is None:
        return quota_commit(-stats.processed_entropy, cand, ctx.floor)
    hit = entropy_bounded(stats.confidence, stats.processed_entropy, cand, gamma)
    return hit | quota_commit(-stats.processed_entropy, cand, ctx.floor)


rnd1_commit = CommitRule(
    rnd1_commit,
    schedule=rnd1_schedule,
    # Without eb_gamma the rule commits exactly the schedule: a step whose count is 0 changes
    # nothing and is skipped (the reference runs its forward anyway).
    exact_floor=lambda settings: settings.eb_gamma is None,
    stats_extras=("processed_entropy",),
)
