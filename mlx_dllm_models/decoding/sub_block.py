"""Fast-dLLM v2's parallel decoding over sub-blocks (Fast_dLLM_QwenForCausalLM.generate).

A block of `block_length` positions is split into sub-blocks of `sub_block_length` (the remote
code's `small_block_size`), decoded left to right: each step proposes a token for every mask and
commits, within the first sub-block that still has masks, every mask whose confidence exceeds
`threshold` (strictly: `x1_p > threshold`) and the most confident one in any case. Later
sub-blocks wait; their positions are computed by the same forward and thrown away, as upstream.

The engine's window ends on the block's last position (block-causal layouts are block-aligned),
so a column's place in its block is read from the right: the first block of a generation may start
inside the block, after the prompt's tail, exactly as the reference's `x_t[:, -block_size:]`.
"""

import mlx.core as mx

from .rules import quota_commit, threshold_commit


def sub_block_index(width: int, block_length: int, sub_block_length: int) -> mx.array:
    """(width,) the sub-block of each column of a window that ends on a block's last position."""
    offset = (block_length - width % block_length) % block_length
    return (mx.arange(width) + offset) // sub_block_length


def sub_block_commit(stats, cand, ctx):
    """The `sub_block` sampler's commit (see the module docstring). The step's quota floor (one a
    step at the default steps == block_length, which is the reference's forced argmax) is taken in
    sub-block order, then by confidence, so that fewer steps than positions still complete the
    block."""
    s = ctx.settings
    sub = sub_block_index(cand.shape[-1], s.block_length, s.sub_block_length)[None, :]
    sub = mx.broadcast_to(sub, cand.shape)
    big = mx.array(cand.shape[-1], dtype=sub.dtype)
    current = mx.where(cand, sub, big).min(axis=-1, keepdims=True)  # (B, 1) first open sub-block
    active = cand & (sub == current)
    conf = stats.confidence
    hits = threshold_commit(conf, active, s.threshold, strict=ctx.spec.strict_threshold)
    # Earlier sub-blocks first: confidences lie in [0, 1], so 2 per sub-block orders them.
    order = conf.astype(mx.float32) - 2.0 * sub.astype(mx.float32)
    return hits | quota_commit(order, cand, ctx.floor)
