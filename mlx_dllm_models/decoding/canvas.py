"""Uniform-noise canvas rules (DiffusionGemma): temperature schedule, per-position statistics,
acceptance, re-noising, stopping. Pure functions on (B, C) / (B, C, V) arrays; the loop lives in
mlx_dllm_models.engine.canvas.

Reproduces transformers' `models/diffusion_gemma/generation_diffusion_gemma.py`
(LinearTemperatureScheduleLogitsProcessor, EntropyBoundSampler, StableAndConfidentStoppingCriteria).
The entropy-bound acceptance itself is `rules.entropy_commit` over every position.
"""

from typing import NamedTuple, Optional, Tuple

import mlx.core as mx

from .stats import softmax_stats


def linear_temperature(remaining: int, steps: int, t_min: float, t_max: float) -> float:
    """The temperature of the step with `remaining` steps left (steps, steps - 1, ..., 1):
    t_max at the first step, falling linearly towards t_min, which the step after the last
    would reach."""
    return t_min + (t_max - t_min) * (remaining / steps)


class CanvasStats(NamedTuple):
    processed: mx.array  # (B, C, V) logits / temperature, read by the sampler and fed back
    sample: mx.array  # (B, C) a draw from softmax(processed)
    argmax: mx.array  # (B, C) the most likely token
    entropy: mx.array  # (B, C) entropy of softmax(processed), nats
    confidence: mx.array  # (B, C) probability of `sample` under softmax(processed)


def canvas_stats(logits: mx.array, temperature: float, uniform: mx.array) -> CanvasStats:
    """Statistics of the temperature-scaled logits. The sample is the inverse CDF of
    softmax(logits / T) at `uniform` (B, C) in [0, 1): one draw per position, a categorical sample
    like the reference's torch.multinomial, from a noise source that is cheap to share. At T = 0,
    the limit: the argmax, with probability 1 and entropy 0 (greedy_stats)."""
    if temperature == 0:
        return greedy_stats(logits)
    processed = logits.astype(mx.float32) / temperature
    p, _, entropy = softmax_stats(processed)
    cdf = mx.cumsum(p, axis=-1)
    target = uniform.astype(mx.float32)[..., None] * cdf[..., -1:]
    vocab = p.shape[-1]
    sample = mx.minimum((cdf <= target).sum(axis=-1), vocab - 1).astype(mx.int32)
    confidence = mx.take_along_axis(p, sample[..., None], axis=-1)[..., 0]
    argmax = mx.argmax(processed, axis=-1).astype(mx.int32)
    return CanvasStats(processed, sample, argmax, entropy, confidence)


def greedy_stats(logits: mx.array) -> CanvasStats:
    """softmax(logits / T) as T falls to 0: all the mass on the argmax, whose sample it is, with
    confidence 1 and entropy 0; the processed logits fed back as self-conditioning are 0 there and
    -inf elsewhere (their softmax is that one-hot distribution)."""
    argmax = mx.argmax(logits, axis=-1).astype(mx.int32)
    top = mx.arange(logits.shape[-1]) == argmax[..., None]
    processed = mx.where(top, 0.0, float("-inf")).astype(mx.float32)
    ones = mx.ones(argmax.shape, dtype=mx.float32)
    return CanvasStats(processed, argmax, argmax, mx.zeros_like(ones), ones)


def renoise(canvas: mx.array, keep: mx.array, noise: mx.array) -> mx.array:
    """Positions outside `keep` take fresh uniform ids (`noise`, same shape as `canvas`)."""
    return mx.where(keep, canvas, noise)


def stable_and_confident(
    history: Optional[mx.array],
    argmax: mx.array,
    entropy: mx.array,
    stability_threshold: int,
    confidence_threshold: float,
) -> Tuple[mx.array, Optional[mx.array]]:
    """StableAndConfidentStoppingCriteria: a row stops when its argmax canvas equals each of the
    previous `stability_threshold` ones and the mean entropy over the canvas is below
    `confidence_threshold`. `history` (k, B, C) holds the last k argmax canvases (None before the
    first step, as if filled with -1). Returns (stop (B,), updated history)."""
    if stability_threshold == 0:
        stable = mx.ones((argmax.shape[0],), dtype=mx.bool_)
        new_history = history
    else:
        if history is None:
            history = mx.full((stability_threshold,) + tuple(argmax.shape), -1, dtype=argmax.dtype)
        stable = (history == argmax[None]).all(axis=-1).all(axis=0)
        new_history = mx.concatenate([history[1:], argmax[None]], axis=0)
    confident = entropy.mean(axis=-1) < confidence_threshold
    return stable & confident, new_history
