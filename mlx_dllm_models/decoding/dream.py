"""Dream's own sampler, `diffusion_generate` (HF generation_utils.py of Dream-org/Dream-v0-*-7B), as
a commit rule and a schedule for the masked block engine. Selected with sampler="dream"; which of
Dream's algorithms runs is the `alg` setting.

The reference decodes the whole canvas as one block over `steps` steps on the timesteps
t = linspace(1, eps, steps + 1). At step i (t = t_i, s = t_{i+1}):

* origin: every mask is committed with probability 1 - s/t (all that are left at the last step),
  with a token sampled from the processed distribution. It draws even at temperature 0.
* maskgit_plus / topk_margin / entropy: the n = int(m * (1 - s/t)) masks (all m left at the last
  step) of highest confidence are committed; confidence is the probability of the proposed token,
  the top-1 minus top-2 probability, or the negative entropy (sum p log p) of the processed
  distribution. With alg_temp > 0 the n positions are drawn without replacement from
  softmax(confidence / alg_temp) instead.

Not to be confused with the shared sampler "entropy" (EB-Sampler, a bound on summed entropy): the
Dream algorithm is sampler="dream", alg="entropy".

Deviation: the reference takes m as the batch mean of the rows' mask counts; here m is per row.
They agree whenever the rows hold as many masks, which is always the case in this engine (every
row starts with max_tokens masks, the ranked algorithms commit the same count per row, and the mask
token is never proposed), so batched and one-by-one decoding give the same tokens.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import SettingsError
from .rule import CommitRule
from .rules import quota_commit
from .stats import uniform as uniform_draws

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def check_alg(value) -> Optional[str]:
    if value not in DREAM_ALGS:
        return f"unknown alg {value!r} for sampler 'dream'; choose one of: {', '.join(DREAM_ALGS)}"
    return None


def check_eps(value) -> Optional[str]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1
    if not ok:
        return f"eps must be in (0, 1) (the last timestep of Dream's schedule), got {value!r}"
    return None


def check_alg_temp(value) -> Optional[str]:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    if not ok:
        return f"alg_temp must be a number >= 0 (0 or null ranks greedily), got {value!r}"
    return None


def timesteps(steps: int, eps: float) -> np.ndarray:
    """linspace(1, eps, steps + 1) in float32, value for value as torch.linspace computes it (each
    half counted from its own end, one rounding per element), so that the step counts
    int(m * (1 - s/t)) truncate exactly as the reference's do."""
    n = steps + 1
    start, end = np.float32(1.0), np.float32(eps)
    if n == 1:
        return np.array([start], np.float32)
    step = float((end - start) / np.float32(n - 1))
    i = np.arange(n)
    from_start = float(start) + step * i
    from_end = float(end) - step * (n - 1 - i)
    return np.where(i < n // 2, from_start, from_end).astype(np.float32)


def _timestep(i: int, steps: int, eps: float) -> np.float32:
    """timesteps(steps, eps)[i], computed alone (same operations), without the (steps + 1,) array."""
    n = steps + 1
    start, end = np.float32(1.0), np.float32(eps)
    step = float((end - start) / np.float32(n - 1))
    value = float(start) + step * i if i < n // 2 else float(end) - step * (n - 1 - i)
    return np.float32(value)


def _transfer_ratios(steps: int, eps: float) -> np.ndarray:
    """(steps,) float32: 1 - s/t of each step, 1 at the last."""
    t = timesteps(steps, eps)
    ratio = np.float32(1) - t[1:] / t[:-1]
    ratio[-1] = 1
    return ratio.astype(np.float32)


def _transfer_ratio(i: int, steps: int, eps: float) -> np.float32:
    """_transfer_ratios(steps, eps)[i] without the (steps,) array (origin reads one per step)."""
    if i == steps - 1:
        return np.float32(1)
    return np.float32(np.float32(1) - _timestep(i + 1, steps, eps) / _timestep(i, steps, eps))


# Dream's exact schedule is a loop over its steps; past this many it is only computed where it is
# known to be all at the last step (below), and refused otherwise.
MAX_SCHEDULED_STEPS = 1 << 20
# alg="origin" takes one forward per step, as the reference does, however few masks are left; more
# steps than this many per mask would be forwards that commit almost nothing.
MAX_ORIGIN_STEPS_PER_MASK = 16


def _ranked_all_at_last(most: int, steps: int, eps: float) -> bool:
    """Whether every count of the ranked schedule but the last is 0 for up to `most` masks:
    int(m * r_i) = 0 when m * r_i < 1, and r_i = 1 - t_{i+1}/t_i <= (t_i - t_{i+1}) / t_i (plus
    float32 rounding), with t_i - t_{i+1} <= (1 - eps)/steps + 2 ulp(1) and t_i >= eps."""
    gap = (1 - eps) / steps + 2.0**-22
    ratio = gap / (eps * (1 - 1e-6)) + 2.0**-23
    return most * ratio * (1 + 1e-6) < 1


def dream_schedule(masks: mx.array, steps: int, settings) -> mx.array:
    """(B, K) int32 per-row commit counts of the first K <= steps steps of Dream's schedule,
    summing to `masks` (B,); every later step's count is 0.

    Ranked algorithms: n_i = int(m_i * (1 - s/t)) with m_i the masks left, all of them at the
    last step. When `steps` is so large that every count but the last is 0, the one step that
    commits is given alone (K = 1): the steps before it change nothing and run no forward (their
    index is not read by the ranked rules), so `steps` above that costs nothing. origin commits a
    random number per step, all that are left at the last (where its transfer probability is 1),
    so its floor is 0: a (B, 1) zero schedule, however many steps."""
    m = np.array(masks, dtype=np.int64)
    most = int(m.max()) if m.size else 0
    if settings.alg == "origin":
        if steps > max(most, 1) * MAX_ORIGIN_STEPS_PER_MASK:
            raise SettingsError(
                f"steps={steps} for {most} masks: alg='origin' runs one forward per step (as "
                f"Dream's reference does), so at most {MAX_ORIGIN_STEPS_PER_MASK} steps per mask "
                f"are allowed; lower steps, or use a ranked alg (maskgit_plus, topk_margin, "
                "entropy), which skips steps that commit nothing"
            )
        out = np.zeros((m.shape[0], 1), np.int64)
        if steps == 1:
            out[:, 0] = m
        return mx.array(out.astype(np.int32))
    if steps > 1 and _ranked_all_at_last(most, steps, settings.eps):
        return mx.array(m[:, None].astype(np.int32))
    if steps > MAX_SCHEDULED_STEPS:
        raise SettingsError(
            f"steps={steps} with eps={settings.eps}: Dream's schedule would have to be computed "
            f"step by step; use steps <= {MAX_SCHEDULED_STEPS}, or a larger eps"
        )
    out = np.zeros((m.shape[0], steps), np.int64)
    ratio = _transfer_ratios(steps, settings.eps)
    left = m.copy()
    for i in range(steps):
        n = left if i == steps - 1 else (left.astype(np.float32) * ratio[i]).astype(np.int64)
        out[:, i] = n
        left = left - n
    return mx.array(out.astype(np.int32))


def uniform(key, shape):
    """Origin's transfer draws; a seam for tests that replay the reference's draws."""
    return uniform_draws(key, shape)


def _gumbel(key, shape):
    u = uniform_draws(key, shape, low=1e-20)
    return -mx.log(-mx.log(u))


# The ranked algorithms' score of a position (the highest commit first).
DREAM_SCORES = {
    "maskgit_plus": lambda stats: stats.confidence,
    "topk_margin": lambda stats: stats.margin,
    "entropy": lambda stats: -stats.processed_entropy,
}


def ranked_score(scores, name: str, stats, ctx) -> mx.array:
    """The score of the `alg` setting's ranked algorithm (`scores`: alg -> score, `name`: the pipeline whose
    algorithms they are) under `alg_temp` (none or 0: greedily). Drawing k positions without
    replacement from softmax(score / alg_temp) is taking the k best of score / alg_temp + Gumbel
    noise."""
    alg = ctx.settings.alg
    if alg not in scores:
        raise ValueError(f"unknown {name} alg {alg!r}")
    score = scores[alg](stats)
    temperature = ctx.settings.alg_temp
    if not temperature:
        return score
    return score / temperature + _gumbel(ctx.key, score.shape)


def dream_commit(stats, cand, ctx):
    """Commit rule of sampler "dream" (see the module docstring); ctx.floor is dream_schedule's."""
    s = ctx.settings
    alg = s.alg
    if alg == "origin":
        p = float(_transfer_ratio(ctx.step, ctx.steps, s.eps))
        hit = uniform(ctx.key, cand.shape) < mx.array(p, dtype=mx.float32)
        return (cand & hit) | quota_commit(stats.confidence, cand, ctx.floor)
    return quota_commit(
        ranked_score(DREAM_SCORES, "diffusion_generate", stats, ctx), cand, ctx.floor
    )


def _exact_floor(settings) -> bool:
    # The ranked algorithms commit exactly the schedule: a step whose count is 0 changes nothing,
    # so the engine skips its forward. origin's commits are random: every step runs.
    return settings.alg != "origin"


def _draws(settings) -> bool:
    # origin's transfers are random; the ranked algorithms draw their positions under alg_temp > 0.
    return settings.alg == "origin" or bool(settings.alg_temp)


dream_commit = CommitRule(
    dream_commit,
    schedule=dream_schedule,
    exact_floor=_exact_floor,
    draws=_draws,
    stats_extras=("margin", "processed_entropy"),
)
