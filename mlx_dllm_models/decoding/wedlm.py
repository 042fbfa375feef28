"""WeDLM's rules (github.com/Tencent/WeDLM, wedlm/engine/sampler.py and wedlm_decoder.py), as pure
functions on a window's rows.

* Which masks a step fills (`Sampler.select_positions_to_fill`): each mask's entropy (of the model's
  raw distribution, whatever the temperature) plus `pos_penalty_factor` times its distance from the
  window's first mask; every mask whose adjusted entropy is below `entropy_threshold` is filled, and
  when none is (or the threshold is None) the one of least adjusted entropy. The penalty makes
  nearer positions go first, which is what lets the committed prefix grow.
* Which window tokens are committed (`_process_pruned_tokens`): the filled positions before the
  window's first mask; their K/V become final.
* Which window tokens each one attends to (`reordered_causal_mask`): the reference moves the filled
  positions before the masks and runs causal attention over that order, with RoPE on the original
  positions. Keeping the window in place and giving the mask that order implies computes the same.
"""

from typing import Optional

import mlx.core as mx
import numpy as np


def adjusted_entropy(entropy: mx.array, masked: mx.array, pos_penalty_factor: float) -> mx.array:
    """(B, L) float32: entropy + pos_penalty_factor * (column - the row's first masked column) at
    masked columns, +inf elsewhere. `masked` (B, L) bool."""
    columns = mx.arange(masked.shape[-1], dtype=mx.float32)
    first = mx.argmax(masked, axis=-1, keepdims=True).astype(mx.float32)
    # float32 as the reference's (index tensor as float) * factor, then added to the entropy.
    penalty = (columns - first) * mx.array(pos_penalty_factor, dtype=mx.float32)
    out = entropy.astype(mx.float32) + penalty
    return mx.where(masked, out, float("inf"))


def wedlm_commit(
    entropy: mx.array,
    masked: mx.array,
    entropy_threshold: Optional[float],
    pos_penalty_factor: float,
) -> mx.array:
    """(B, L) bool: the masks a step fills. Strictly below the threshold, as the reference's `<`;
    the fallback is the first column of least adjusted entropy (torch's argmin). A row without masks
    fills nothing."""
    adjusted = adjusted_entropy(entropy, masked, pos_penalty_factor)
    columns = mx.arange(masked.shape[-1])
    best = columns == mx.argmin(adjusted, axis=-1, keepdims=True)
    fallback = best & masked
    if entropy_threshold is None:
        return fallback
    hit = masked & (adjusted < entropy_threshold)
    return mx.where(mx.any(hit, axis=-1, keepdims=True), hit, fallback)


def committed_prefix(filled) -> int:
    """How many of a window's positions are committed: the filled ones before its first mask."""
    for i, f in enumerate(filled):
        if not f:
            return i
    return len(filled)


def reordered_causal_mask(filled, first_row: int = 0) -> mx.array:
    """(n - first_row, n) bool keep mask (rows first_row..n-1, every column) of causal attention
    over the order "filled positions, then masks" (each group in column order), expressed over the
    columns in place: a filled position sees the filled ones up to itself, a mask sees every filled
    position and the masks up to itself. Committed tokens count as filled, so over
    [context ; window] the context stays causal. Only the rows a forward runs are built: a step
    over a long context costs (window x n), not (n x n)."""
    f = np.asarray(filled, dtype=bool)
    cols = np.arange(len(f))
    rows = cols[first_row:, None]
    fr = f[first_row:, None]
    keep = ((cols[None, :] <= rows) & (f[None, :] == fr)) | (f[None, :] & ~fr)
    return mx.array(keep)
