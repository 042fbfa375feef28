"""LLaDA2.2's Levenshtein editing rules (the checkpoint's `_joint_decode_block` and
`_apply_edit_operations_with_tracking`): pure functions over (B, L) windows.

A step of 2.2 fills masks (M2T) and rewrites committed tokens (T2T) as 2.1 does, except that
a proposal may be one of two edit-control tokens: DELETE removes its position, SPLIT turns its
position into [mask, the token it replaced]. The block then shifts and is padded with masks, or
cut, back to its length. A mask the edits create is "new" (not original); each step's fill takes
the transfer schedule's share of the original masks plus every new one.
"""

import mlx.core as mx

from .rules import quota_commit


def transfer_floor(initial: mx.array, steps: int, step: mx.array) -> mx.array:
    """(B,) the schedule's share at each row's step: `initial` masks spread over `steps` steps,
    the remainder on the first ones (`_get_num_transfer_tokens`)."""
    return initial // steps + (step < initial % steps).astype(initial.dtype)


def levenshtein_fill(confidence, cand, threshold: float, need, strict: bool = True) -> mx.array:
    """The step's mask-to-token commits: every candidate above `threshold` when they are at least
    `need` (B,), else the `need` most confident ones. Unlike 2.1's rule, nothing is forced when
    `need` is 0."""
    passes = (confidence > threshold) if strict else (confidence >= threshold)
    high = cand & passes
    enough = high.sum(axis=1) >= need
    return mx.where(enough[:, None], high, quota_commit(confidence, cand, need))


def apply_edit_ops(block, old, original, gen, mask_id: int, delete_id: int, split_id: int):
    """(block, original) after the step's DELETE / SPLIT tokens are consumed.

    `block` is the window after the step's writes, `old` before them; `original` (B, L) marks the
    block's original masks; `gen` the positions edits may move (the prompt's tail in a first
    block, or any prompt token of the window, stays in place). The generated positions, read left
    to right as one sequence, are rewritten: DELETE contributes nothing, SPLIT a new mask then the
    token it replaced (keeping that position's original flag), any other token itself; the result
    is cut to the number of generated positions or padded with new masks, and written back into
    them in order.

    Computed by gathers: the generated position of rank j (counted among the generated ones) takes
    its token from the first position whose running contribution count exceeds j."""
    is_del = gen & (block == delete_id)
    is_split = gen & (block == split_id)
    counts = mx.where(gen, mx.where(is_del, 0, mx.where(is_split, 2, 1)), 0).astype(mx.int32)
    end = mx.cumsum(counts, axis=1)
    total = end[:, -1:]
    j = mx.cumsum(gen.astype(mx.int32), axis=1) - 1  # each generated position's rank
    src = (end[:, None, :] <= j[:, :, None]).astype(mx.int32).sum(axis=-1)
    src = mx.minimum(src, block.shape[1] - 1)
    offset = j - mx.take_along_axis(end - counts, src, axis=1)
    split_src = mx.take_along_axis(is_split, src, axis=1)
    inserted = split_src & (offset == 0)
    tokens = mx.where(
        split_src,
        mx.where(inserted, mask_id, mx.take_along_axis(old, src, axis=1)),
        mx.take_along_axis(block, src, axis=1),
    )
    flags = mx.take_along_axis(original, src, axis=1) & ~inserted
    pad = j >= total
    tokens = mx.where(pad, mask_id, tokens)
    flags = flags & ~pad
    return (
        mx.where(gen, tokens, block).astype(block.dtype),
        mx.where(gen, flags, original),
    )
