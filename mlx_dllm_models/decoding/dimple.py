"""Dimple's decoding pipeline "dim" (yu-rp/Dimple generation_utils.py, `_sample` with
decoding_pipeline="dim"), the sampler "dimple": a commit rule and its schedule for the masked block
engine. Which of its algorithms runs is the `alg` setting; `alg_p_threshold` is its confident
decoding.

The reference decodes the whole canvas as one block, at most `steps` steps on the timesteps
t = linspace(1, eps, steps + 1), and stops once no mask is left. At step i, with m masks left of
the M it started with:

* confident decoding (alg_p_threshold > 0): every mask whose score (the proposal's probability;
  entropy's negative entropy, which never does) exceeds the threshold is committed (every mask at
  the last step); if none does, the step falls back to:
* the fallback count n: from t = m / M, the first timestep index j >= max(i + 1, the first index
  whose timestep is below t) at which n = int(m * (1 - t_j / t)) >= 1 (n = m at the last
  timestep). origin commits n masks drawn at random; origin-ratio each mask with probability
  1 - t_j / t (1 at the last timestep); autoregressive the leftmost mask; maskgit_plus the n most
  confident; entropy the n of lowest entropy (of the model's own distribution: the README's
  use_original_confidence=True). With alg_temp > 0 the ranked algorithms draw the n positions
  without replacement from softmax(score / alg_temp) instead.

The proposals are the engine's (temperature, then top-p, then top-k); their confidence is the
model's own probability (use_original_confidence=True, the spec's confidence "raw").

Deviations: the reference counts m and M over the whole batch, ranks the n best over the batch's
masks together and applies the threshold's fallback only when no position of the batch passes; here
each row is decoded on its own counts (M = the row's canvas). One row alone is the reference. Its
topk_margin (the margin of the model's own distribution) and use_original_confidence=False are not
offered.
"""

import mlx.core as mx
import numpy as np

from ..errors import SettingsError
from .dream import ranked_score, timesteps
from .rule import CommitRule
from .rules import quota_commit
from .stats import uniform

DIMPLE_ALGS = ("origin", "origin-ratio", "autoregressive", "maskgit_plus", "entropy")
# The algorithms only the "dim" pipeline has (settings: refused with sampler "dream").
DIMPLE_ONLY_ALGS = ("origin-ratio", "autoregressive")


def dimple_schedule(masks: mx.array, steps: int, settings) -> mx.array:
    """(B, steps) floors: nothing before the last step, which commits every mask left (the
    reference's last step commits them all, by its threshold branch or its fallback count)."""
    if settings.alg not in DIMPLE_ALGS:
        raise SettingsError(
            f"alg={settings.alg!r} is not one of sampler 'dimple''s algorithms "
            f"({', '.join(DIMPLE_ALGS)}); use sampler='dream' for Dream's"
        )
    out = np.zeros((masks.shape[0], max(steps, 1)), np.int32)
    out[:, -1] = np.array(masks, dtype=np.int32)
    return mx.array(out)


def fallback_counts(left: mx.array, total: mx.array, step: int, steps: int, eps: float):
    """(B,) int32 counts and (B,) float32 ratios 1 - s/t: the "dim" pipeline's number of masks to
    commit at `step` when the threshold commits nothing, for rows with `left` of `total` masks,
    and origin-ratio's transfer probability (float32, as the reference's tensors)."""
    ts = mx.array(timesteps(steps, eps))
    m = left.astype(mx.float32)[:, None]
    t = m / total.astype(mx.float32)[:, None]
    below = ts[None] < t
    first = mx.argmax(below, axis=1)
    start = mx.maximum(first, step + 1)[:, None]
    n = mx.floor(m * (1 - ts[None] / t))
    n = mx.where(ts[None] > ts[-1], n, m).astype(mx.int32)
    ratio = mx.where(ts[None] > ts[-1], 1 - ts[None] / t, 1.0)
    j = mx.arange(ts.shape[0])[None]
    ok = (j >= start) & (n >= 1)
    pick = mx.argmax(ok, axis=1)[:, None]
    return mx.take_along_axis(n, pick, axis=1)[:, 0], mx.take_along_axis(ratio, pick, axis=1)[:, 0]


def dimple_commit(stats, cand, ctx):
    """Commit rule of sampler "dimple" (see the module docstring)."""
    s = ctx.settings
    alg = s.alg
    last = ctx.step >= ctx.steps - 1
    total = ctx.generated.sum(axis=1)  # the row's canvas: every position started masked
    n, ratio = fallback_counts(cand.sum(axis=1), total, ctx.step, ctx.steps, s.eps)
    if alg == "origin-ratio":
        counted = cand & (uniform(ctx.key, cand.shape) < ratio[:, None])
    elif alg == "autoregressive":  # the leftmost mask of each row
        counted = quota_commit(-mx.arange(cand.shape[1], dtype=mx.float32)[None], cand, 1)
    else:
        counted = quota_commit(_score(stats, cand, ctx), cand, n)
    threshold = s.alg_p_threshold
    if not threshold:
        return counted
    # The alg's own score meets the threshold (entropy's, a negative entropy, never does).
    passes = (-stats.entropy if alg == "entropy" else stats.confidence) > threshold
    hit = cand if last else cand & passes
    return mx.where(hit.any(axis=1, keepdims=True), hit, counted)


# The ranked algorithms' score of a position (Dream's, without topk_margin; entropy unprocessed).
DIMPLE_SCORES = {
    "maskgit_plus": lambda stats: stats.confidence,
    "entropy": lambda stats: -stats.entropy,
}


def _score(stats, cand, ctx):
    """The ranked algorithms' score (origin's: random, a random subset of n)."""
    if ctx.settings.alg == "origin":
        return uniform(ctx.key, cand.shape)  # randperm's random subset
    return ranked_score(DIMPLE_SCORES, "Dimple", stats, ctx)


def _draws(settings) -> bool:
    # origin's subset and origin-ratio's transfers are random; the ranked algorithms draw their
    # positions under alg_temp > 0 (autoregressive ranks by column alone).
    alg = settings.alg
    return alg in ("origin", "origin-ratio") or (alg in DIMPLE_SCORES and bool(settings.alg_temp))


dimple_commit = CommitRule(dimple_commit, schedule=dimple_schedule, draws=_draws)
