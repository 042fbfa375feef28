"""MaskGIT's parallel decoding of image tokens, as MMaDA's t2i_generate computes it (pure rules).

One step over the (B, N) image tokens of a batch (codebook indices; `known` says which are
decided): classifier-free guidance `(1 + g) * cond - g * uncond` on the codebook's logits, a
sample of every position from its softmax (inverse CDF of a given uniform: torch's multinomial
draws cannot be reproduced, so the draws are inputs), the decided tokens kept, the cosine
schedule's number of positions to mask again, and muse's mask_by_random_topk: the lowest
`log p + temperature * gumbel` are masked, decided tokens never (their confidence is float32's
max). The temperature is annealed by `temperature * (1 - ratio)` after every step, compounding,
as the reference reassigns it.
"""

import math
from typing import NamedTuple, Tuple

import mlx.core as mx
import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
LOG_EPS = 1e-20


def guided(cond: mx.array, uncond, scale: float) -> mx.array:
    """MMaDA's (muse's) guidance: `(1 + g) * cond - g * uncond`; `cond` alone when g is 0."""
    if uncond is None or scale == 0:
        return cond
    return (1 + scale) * cond - scale * uncond


def cosine_mask_ratio(step: int, steps: int) -> float:
    """cos(ratio * pi / 2) at ratio (step + 1) / steps, as torch computes it on
    `torch.tensor(ratio)`: the argument in float32, its cosine rounded to float32 (torch's own
    float32 cosine may differ by an ulp; the floor of N times it agreed with torch's at every N in
    16..4096 and steps up to 100)."""
    ratio = np.float32((step + 1) / steps)
    angle = np.float32(ratio * np.float32(math.pi)) * np.float32(0.5)
    return float(np.float32(math.cos(float(angle))))


def mask_lengths(step: int, steps: int, n_tokens: int, unknown: mx.array) -> mx.array:
    """(B,) number of positions masked again after this step: floor(N * mask_ratio) (float32),
    at least 1 and at most one fewer than the row's unknown positions, as the reference clamps."""
    ratio = np.float32(cosine_mask_ratio(step, steps))
    wanted = int(np.floor(np.float32(n_tokens) * ratio))
    return mx.maximum(mx.minimum(unknown.sum(axis=-1) - 1, wanted), 1)


def annealed(temperature: float, step: int, steps: int) -> float:
    """The running temperature after `step`'s reassignment (the one its masking uses): the
    previous step's value times (1 - ratio)."""
    return temperature * (1.0 - (step + 1) / steps)


def sample_inverse_cdf(probs: mx.array, uniforms: mx.array) -> mx.array:
    """Index of the first cumulative probability above each uniform (a categorical draw)."""
    cdf = mx.cumsum(probs, axis=-1)
    idx = (cdf <= uniforms[..., None]).sum(axis=-1)
    return mx.minimum(idx, probs.shape[-1] - 1).astype(mx.int32)


def gumbel(uniforms: mx.array) -> mx.array:
    """muse's gumbel_noise: -log(-log(u)), both logs clamped at 1e-20."""
    inner = -mx.log(mx.maximum(uniforms, LOG_EPS))
    return -mx.log(mx.maximum(inner, LOG_EPS))


def random_topk_masking(
    mask_len: mx.array, probs: mx.array, temperature: float, uniforms: mx.array
) -> mx.array:
    """mask_by_random_topk: True where the confidence is below the row's `mask_len`-th smallest."""
    confidence = mx.log(mx.maximum(probs, LOG_EPS)) + temperature * gumbel(uniforms)
    ordered = mx.sort(confidence, axis=-1)
    cut = mx.take_along_axis(ordered, mask_len.astype(mx.int32)[:, None], axis=-1)
    return confidence < cut


class MaskGitState(NamedTuple):
    """What a step rule reads besides the logits and the draws: the current codebook indices
    (B, N), read where `known` (B, N) holds; the step of `steps`; the running temperature before
    this step's reassignment; each row's masked count at the start of the run (B,)."""

    tokens: mx.array
    known: mx.array
    step: int
    steps: int
    temperature: float
    initial: mx.array


def maskgit_step(
    logits: mx.array, state: MaskGitState, sample_uniforms: mx.array, gumbel_uniforms: mx.array
) -> Tuple[mx.array, mx.array, float]:
    """One step: (sampled (B, N) codebook indices, every position's; masking (B, N): the positions
    left masked for the next step; the running temperature for the next step). `logits` (B, N, C)
    are the guided codebook logits."""
    tokens, known, step, steps, temperature, _ = state
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    sampled = mx.where(known, tokens, sample_inverse_cdf(probs, sample_uniforms))
    chosen = mx.take_along_axis(probs, sampled[..., None], axis=-1)[..., 0]
    chosen = mx.where(known, FLOAT32_MAX, chosen)
    mask_len = mask_lengths(step, steps, tokens.shape[-1], ~known)
    t = annealed(temperature, step, steps)
    masking = random_topk_masking(mask_len, chosen, t, gumbel_uniforms)
    return sampled, masking, t
