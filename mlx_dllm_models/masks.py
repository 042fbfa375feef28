"""Attention layouts as boolean keep-masks (True = may attend), shaped for mlx's SDPA.

Every mask broadcasts to (B, n_heads, L_query, L_key). `None` means attend to everything.
"""

from typing import Optional, Sequence

import mlx.core as mx


def every_key(length: int) -> mx.array:
    """A keep-mask under which every query sees all `length` keys: bidirectional attention given
    explicitly (a call without a mask is the upstream model's own forward, which is causal or
    block-causal for some families)."""
    return mx.ones((1, 1, 1, length), dtype=mx.bool_)


def padding_mask(
    left_padding: Sequence[int], length: int, ends: Optional[Sequence[int]] = None
) -> Optional[mx.array]:
    """Bidirectional attention over a left-padded batch, as Dream does it: pads are never attended.
    `ends` (optional, per row): columns from a row's end on are padding too (right padding).

    A pad query still attends to itself, so that its row of the softmax is never empty: an all-masked
    row gives NaN, and NaN values would reach real rows through 0 * NaN in the next layer.
    """
    if not any(int(p) for p in left_padding) and ends is None:
        return None
    cols = mx.arange(length)
    valid = cols[None, :] >= mx.array(left_padding, dtype=mx.int32)[:, None]  # (B, L)
    if ends is not None:
        valid = valid & (cols[None, :] < mx.array(ends, dtype=mx.int32)[:, None])
    keep = valid[:, None, :] | mx.eye(length, dtype=mx.bool_)[None]
    return keep[:, None]  # (B, 1, L, L)


def block_causal_mask(
    length: int,
    block_length: int,
    offset: int = 0,
    left_padding: Optional[Sequence[int]] = None,
    on_columns: bool = False,
    ends: Optional[Sequence[int]] = None,
) -> mx.array:
    """Block-causal keep-mask for `length` queries at absolute positions offset..offset+length-1
    against keys 0..offset+length-1: a query in block b sees every key in blocks <= b.

    Blocks are aligned on absolute positions (0, B, 2B, ...), as SDAR and LLaDA2 are trained.
    With left padding, positions are counted per row from the first real token; `on_columns`
    counts blocks on the columns instead (dllm's BD3LM sampler: padding fills the prompt up to
    whole blocks, and is never attended). `ends` (per row): columns from a row's end on are never
    attended either (a batch whose last blocks stop at each row's max_tokens: a row alone has no
    column there).
    """
    q = mx.arange(offset, offset + length)
    k = mx.arange(offset + length)
    if left_padding is None and ends is None:
        keep = (k[None, :] // block_length) <= (q[:, None] // block_length)
        return keep[None, None]
    if left_padding is None:
        left_padding = [0] * len(ends)
    pad = mx.array(left_padding, dtype=mx.int32)[:, None, None]
    qp = q[None, :, None] - (0 if on_columns else pad)
    kp = k[None, None, :] - (0 if on_columns else pad)
    keep = ((kp // block_length) <= (qp // block_length)) & (k[None, None, :] >= pad)
    if ends is not None:
        keep = keep & (k[None, None, :] < mx.array(ends, dtype=mx.int32)[:, None, None])
    keep = keep | (q[None, :, None] == k[None, None, :])
    return keep[:, None]


def causal_mask(length: int, offset: int = 0) -> mx.array:
    q = mx.arange(offset, offset + length)
    k = mx.arange(offset + length)
    return (k[None, :] <= q[:, None])[None, None]


def causal_prefix_mask(
    length: int, prefix: int, offset: int = 0, left_padding: Optional[Sequence[int]] = None
) -> mx.array:
    """Keep-mask for `length` queries at columns offset..offset+length-1 against keys
    0..offset+length-1: a query before column `prefix` attends causally; a query at or after it
    attends to every key before `prefix` and to every key from `prefix` on (Nemotron's causal
    prefix + bidirectional block). prefix >= offset + length gives the plain causal mask.

    With left padding, pad keys are never attended (a pad query still attends to itself, so that
    no softmax row is empty).
    """
    q = mx.arange(offset, offset + length)[:, None]
    k = mx.arange(offset + length)[None, :]
    keep = (k <= q) | ((q >= prefix) & (k >= prefix))
    if left_padding is None or not any(int(p) for p in left_padding):
        return keep[None, None]
    pad = mx.array(left_padding, dtype=mx.int32)[:, None, None]
    keep = (keep[None] & (k[None] >= pad)) | (q[None] == k[None])
    return keep[:, None]


def rows_prefix_mask(starts, splits, stops, length: int) -> mx.array:
    """(B, 1, length, max(stops)) keep-mask of a batch whose rows sit at columns of their own
    (self-speculation's rows keep a different number of tokens every round): row b's queries are
    columns starts[b]..starts[b]+length-1, a query before splits[b] attends causally and one from
    splits[b] on to every key before stops[b] (causal_prefix_mask's layout). Keys from stops[b] on
    (padding, or columns another row's forward reaches) are never attended; a padding query (from
    stops[b] on) attends to column 0 only, so that no softmax row is empty.
    """

    def per_row(values):
        return mx.array(list(values), dtype=mx.int32)[:, None, None]

    q = per_row(starts) + mx.arange(length)[None, :, None]
    k = mx.arange(max(stops))[None, None, :]
    stop = per_row(stops)
    keep = ((k <= q) | (q >= per_row(splits))) & (k < stop)
    keep = mx.where(q >= stop, k == 0, keep)
    return keep[:, None]


def prompt_block_mask(
    length: int, prompt_end: int, block_length: int, left_padding: Optional[Sequence[int]] = None
) -> mx.array:
    """Keep-mask for queries at columns 0..length-1 against the same keys when the prompt
    (columns before `prompt_end`) is one segment and each `block_length` columns after it another:
    a query attends to every key of its own segment and of the segments before it. This is the
    attention that Nemotron's generate_with_prefix_cache_block_diff gives its KV cache with
    causal_context=False (the prompt encoded bidirectionally, then each finished block
    bidirectionally against it), as one mask for full recompute.

    With left padding, pad keys are never attended (a pad query still attends to itself).
    """
    cols = mx.arange(length)
    segment = mx.where(cols < prompt_end, 0, 1 + (cols - prompt_end) // block_length)
    keep = segment[None, :] <= segment[:, None]
    if left_padding is None or not any(int(p) for p in left_padding):
        return keep[None, None]
    pad = mx.array(left_padding, dtype=mx.int32)[:, None, None]
    keep = (keep[None] & (cols[None, None, :] >= pad)) | mx.eye(length, dtype=mx.bool_)[None]
    return keep[:, None]
