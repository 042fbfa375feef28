"""Lumina-DiMOO's MaskGIT step (generators/image_generation_generator.py's generate_image), pure.

How it differs from MMaDA's (decoding/maskgit.py): only the masked positions are sampled (the
decided ones keep their tokens), by gumbel-max at the temperature (`argmax(logits / t + g)`, a
uniform per codebook entry; greedy at 0); the number left masked is `floor(n0 * cos(pi/2 *
(step + 1) / steps))` of the run's initial masked count n0, at least 1, and none after the last
step; the masked positions with the lowest `log p + t * g` stay masked (mask_by_random_topk, the
cut index clamped to the masked count less one). The temperature is not annealed. Its gumbel
noise is `-log(-log(u + 1e-20) + 1e-20)`. The uniforms are inputs, as in decoding/maskgit.py.
"""

import math
from typing import Tuple

import mlx.core as mx
import numpy as np

from .maskgit import MaskGitState

EPS = 1e-20


def gumbel(uniforms: mx.array) -> mx.array:
    """utils/generation_utils.py's gumbel_noise of given uniforms."""
    return -mx.log(-mx.log(uniforms + EPS) + EPS)


def keep_fraction(step: int, steps: int) -> float:
    """cosine_schedule(torch.tensor([(step + 1) / steps])): float32 throughout, as torch computes
    a float32 tensor times a Python float."""
    t = np.float32((step + 1) / steps)
    angle = np.float32(np.float32(0.5 * math.pi) * t)
    return float(np.float32(math.cos(float(angle))))


def keep_counts(step: int, steps: int, initial: mx.array) -> mx.array:
    """(B,) positions to leave masked after `step`: floor(n0 * fraction) (float32) at least 1;
    0 after the last step."""
    if step >= steps - 1:
        return mx.zeros(initial.shape, dtype=mx.int32)
    frac = mx.array(keep_fraction(step, steps), dtype=mx.float32)
    return mx.maximum(mx.floor(initial.astype(mx.float32) * frac), 1).astype(mx.int32)


def gumbel_max_step(
    logits: mx.array, state: MaskGitState, sample_uniforms: mx.array, gumbel_uniforms: mx.array
) -> Tuple[mx.array, mx.array, float]:
    """(sampled (B, N) codebook indices, the decided ones kept; masking (B, N): the positions
    left masked; the temperature, unchanged). `logits` (B, N, C) are the guided codebook logits,
    `sample_uniforms` (B, N, C), `gumbel_uniforms` (B, N)."""
    tokens, known, step, steps, temperature, initial = state
    logits = logits.astype(mx.float32)
    if temperature == 0:
        drawn = mx.argmax(logits, axis=-1)
    else:
        drawn = mx.argmax(logits / temperature + gumbel(sample_uniforms), axis=-1)
    sampled = mx.where(known, tokens, drawn.astype(mx.int32))
    probs = mx.softmax(logits, axis=-1)
    chosen = mx.take_along_axis(probs, sampled[..., None], axis=-1)[..., 0]
    confidence = mx.log(mx.maximum(chosen, EPS)) + temperature * gumbel(gumbel_uniforms)
    # Decided positions take no part in the ranking: +inf sorts them after every masked one, and
    # the cut index stays below the masked count.
    confidence = mx.where(known, mx.inf, confidence)
    masked = (~known).sum(axis=-1)
    cut_at = mx.maximum(mx.minimum(keep_counts(step, steps, initial), masked - 1), 0)
    ordered = mx.sort(confidence, axis=-1)
    cut = mx.take_along_axis(ordered, cut_at.astype(mx.int32)[:, None], axis=-1)
    return sampled, confidence < cut, temperature
