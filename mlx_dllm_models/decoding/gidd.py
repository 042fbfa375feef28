"""GIDD's denoising rules (GiddForDiffusionLM.generate in dvruette/gidd-easydel's
modeling_gidd_hf.py), pure functions on float32 arrays.

The noise at log-SNR λ mixes the data with π(λ): a share sigmoid(λ + noise_type) of uniform ids (the
mask id excluded, each of the others 1 / (vocab - 1)) and the rest on the mask id, so noise_type
1000 is uniform noise and -1000 masking. A block's `steps` steps walk λ from min_log_snr up to
max_log_snr along α(t) = (α_max - α_min) f(t) + α_min, f the cosine or linear schedule.

- `ancestral`: every position of the block is redrawn from the posterior p(z_s | z_t, x̂), x̂ the
  model's (tempered, filtered) distribution (`_sample_ancestral`);
- `adaptive`: the `tokens_per_step` positions whose current token is likeliest noise and least
  likely under the model ((p_max - p(z)) · π(z), π normalized over the block) take a draw from the
  model (`_sample_adaptive`).
"""

import math
from typing import Optional, Tuple

import mlx.core as mx

from .maskgit import sample_inverse_cdf
from .stats import filter_logits


def log_snr_schedule(steps: int, schedule: str, min_log_snr: float, max_log_snr: float) -> mx.array:
    """(steps + 1,) float32 log-SNRs; index `steps` is the noisiest, 0 the cleanest."""
    lo, hi = mx.array(min_log_snr, mx.float32), mx.array(max_log_snr, mx.float32)
    alpha_min, alpha_max = mx.sigmoid(lo), mx.sigmoid(hi)
    ts = mx.linspace(0.0, 1.0, steps + 1, dtype=mx.float32)
    if schedule == "linear":
        f = 1.0 - ts
    else:
        f = 0.5 + 0.5 * mx.cos(ts * math.pi)
    alpha = (alpha_max - alpha_min) * f + alpha_min
    return mx.clip(mx.log(alpha / (1.0 - alpha)), lo, hi)


def noise_mix(log_snr: mx.array, noise_type: float, vocab: int, mask_id: int) -> mx.array:
    """π(λ): (vocab,) float32."""
    alpha = mx.sigmoid(log_snr + noise_type)
    is_mask = mx.arange(vocab) == mask_id
    return mx.where(is_mask, 1.0 - alpha, alpha * (1.0 / (vocab - 1))).astype(mx.float32)


def prior(uniforms: mx.array, ids: mx.array, min_log_snr: float, noise_type: float, mask_id: int):
    """The canvas's starting noise (`_sample_prior`): a uniform id where the draw falls below
    sigmoid(min_log_snr + noise_type), else the mask id."""
    share = mx.sigmoid(mx.array(min_log_snr, mx.float32) + noise_type)
    return mx.where(uniforms < share, ids, mask_id).astype(mx.int32)


def token_probs(
    logits: mx.array, temperature: float, top_k: Optional[int], top_p: Optional[float]
) -> mx.array:
    """`_probs_with_topk_topp`: one-hot argmax at temperature 0; else softmax of logits / T after
    top-k (ties with the k-th kept) and top-p (the smallest prefix of the sorted distribution
    whose mass reaches p)."""
    if temperature == 0:
        top = mx.argmax(logits, axis=-1, keepdims=True)
        return (mx.arange(logits.shape[-1]) == top).astype(mx.float32)
    return mx.softmax(filter_logits(logits / temperature, top_k, top_p), axis=-1)


def draw(probs: mx.array, uniforms: mx.array) -> mx.array:
    """torch.multinomial's categorical draw, by inverse CDF of given uniforms (weights need not
    sum to one)."""
    return sample_inverse_cdf(probs / probs.sum(axis=-1, keepdims=True), uniforms)


def ancestral_probs(
    z: mx.array,
    x_hat: mx.array,
    log_snrs: Tuple[mx.array, mx.array],
    noise_type: float,
    mask_id: int,
) -> mx.array:
    """(B, L, V) weights of p(z_s | z_t = z, x̂) for (λ_t, λ_s) = `log_snrs` (q_s where z is
    impossible at t)."""
    vocab = x_hat.shape[-1]
    t, s = log_snrs
    alpha_s, alpha_t = mx.sigmoid(s), mx.sigmoid(t)
    beta_s, beta_t = 1.0 - alpha_s, 1.0 - alpha_t
    alpha_t_s = alpha_t / alpha_s
    pi_s = noise_mix(s, noise_type, vocab, mask_id)
    pi_t = noise_mix(t, noise_type, vocab, mask_id)
    beta_pi_t_s = beta_t * pi_t - alpha_t_s * beta_s * pi_s
    q_t = alpha_t * x_hat + beta_t * pi_t
    q_s = alpha_s * x_hat + beta_s * pi_s
    q_t_at_z = mx.take_along_axis(q_t, z[..., None], axis=-1)
    one_hot = (mx.arange(vocab) == z[..., None]).astype(q_t.dtype)
    q_t_s_at_z = alpha_t_s * one_hot + beta_pi_t_s[z][..., None]
    # A token the noise at t cannot hold (the mask id in a uniform-noise canvas: the prior draws
    # any id) has no posterior, 0 / 0 (upstream's torch.multinomial raises there): it is drawn
    # from q_s, as if nothing had been observed.
    seen = q_t_at_z > 0
    return mx.where(seen, q_s * q_t_s_at_z / mx.where(seen, q_t_at_z, 1.0), q_s)


def adaptive_positions(
    z: mx.array, logits: mx.array, log_snr: mx.array, noise_type: float, mask_id: int, n: int
) -> mx.array:
    """(B, L) bool: the `n` positions of each row the adaptive sampler changes this step."""
    vocab = logits.shape[-1]
    p_noise = noise_mix(log_snr, noise_type, vocab, mask_id)[z]
    total = p_noise.sum(axis=-1, keepdims=True)
    # A block with no noise left (masked noise once every mask is filled) divides 0 by 0 upstream,
    # whose top-k of NaN then picks positions by torch's order: here such a row changes nothing.
    noisy = total > 0
    p_noise = p_noise / mx.where(noisy, total, 1.0)
    x_hat = mx.softmax(logits, axis=-1)
    p_curr = mx.take_along_axis(x_hat, z[..., None], axis=-1)[..., 0]
    delta = (x_hat.max(axis=-1) - p_curr) * p_noise
    n = min(n, z.shape[-1])
    # torch.topk: the largest first (positions of equal score in index order).
    picked = mx.argsort(-delta, axis=-1)[:, :n]
    chosen = mx.zeros(z.shape, mx.bool_)
    return mx.put_along_axis(chosen, picked, mx.array(True), axis=-1) & noisy
