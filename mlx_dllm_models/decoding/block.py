"""Rules of the block-diffusion references (SDAR generate.py, LLaDA2.x modeling generate).

SDAR's remasking strategies map onto the engine's samplers: `low_confidence_static` is "quota"
(the block length split over the steps, front-loaded), `low_confidence_dynamic` is "threshold"
(every mask above the threshold, > as in the reference, with the step's quota as the fallback),
and `sequential` and `entropy_bounded` are the rules below.

LLaDA2.1 token editing (T2T) is not a sampler: it runs next to any commit rule, driven by the
`editing_threshold` and `max_post_steps` settings of a family that declares them (see
engine.MaskedBlockDecoder). LLaDA2.0 is the threshold sampler with editing off.

Where the engine departs from the references, on purpose:

* A step commits min(quota, masks left). SDAR's top-k runs over the whole block with confidence
  -inf outside the masks, so a quota above the masks left rewrites committed or prompt tokens.
* The mask token is never proposed. LLaDA2.1's edits can write it back (turning a token into a
  mask again) when it is the most probable token; SDAR / LLaDA2.0 would leave a mask in place.
* LLaDA2.1 commits at least num_to_transfer=1 mask a step and ignores `steps`; here the floor is
  the schedule of block_length over `steps`, which is one a step at the default steps ==
  block_length. LLaDA2.x also caps steps at gen_length // minimal_topk; not reproduced.
* SDAR's reference divides the logits by the temperature: temperature 0 is greedy here.
"""

from typing import Optional

import mlx.core as mx

from .rule import CommitRule, always
from .rules import edit_commit, quota_commit


def sequential_commit(stats, cand, ctx):
    """SDAR `sequential`: commit the leftmost masks, as many as the step's quota. The reference
    commits a contiguous run from the first mask, which is the same set since its masks always
    form a suffix of the block."""
    leftmost_first = -mx.arange(cand.shape[-1], dtype=mx.float32)
    return quota_commit(mx.broadcast_to(leftmost_first, cand.shape), cand, ctx.floor)


sequential_commit = CommitRule(sequential_commit, exact_floor=always)


def entropy_bounded_commit(stats, cand, ctx):
    """SDAR `entropy_bounded` (JetAstra/SDAR generate.py, `eb_threshold`), as upstream computes it.

    Its entropy is taken of x0_p, the (B, L) probabilities of the sampled tokens, over the last
    axis: E = -sum_i p_i log p_i summed over the block's positions (masked or not), one value per
    row that every mask shares, not a per-token entropy over the vocabulary (the shared "entropy"
    sampler's EB-Sampler rule). The masks sorted by it all tie at E, so the running sum n * E
    commits k = #{n >= 1: n E < eb_threshold} masks, at least one and at most the masks left;
    which ones is the sort's order among ties, position order here (torch.sort on CPU). The step's
    quota floor is the leftmost masks too: max(k, floor) leftmost masks, which is k at the default
    steps == block_length (the floor is 1 there); upstream has no floor.

    The sum covers the positions the engine computes logits for: the block from its first
    generated position. Upstream's block also holds the prompt tokens that share the first block;
    they agree whenever the prompt ends on a block edge."""
    p = mx.maximum(stats.confidence.astype(mx.float32), 1e-12)
    e = -(p * mx.log(p)).sum(axis=-1, keepdims=True)  # (B, 1)
    masked = cand.sum(axis=-1, keepdims=True)
    running = mx.cumsum(mx.broadcast_to(e, cand.shape), axis=-1)  # n * E, n = 1..L
    n = (running < ctx.settings.eb_threshold).sum(axis=-1, keepdims=True)
    k = mx.maximum(mx.maximum(mx.minimum(n, masked), 1), ctx.floor[:, None])
    leftmost_first = -mx.arange(cand.shape[-1], dtype=mx.float32)
    return quota_commit(mx.broadcast_to(leftmost_first, cand.shape), cand, k[:, 0])


def token_edits(stats, tokens, editable, threshold: float, strict: bool = True):
    """LLaDA2.1 T2T edits of one step: committed, editable positions (generated, not prompt) whose
    proposal differs from their token with confidence above `threshold`."""
    return edit_commit(
        stats.x0.astype(tokens.dtype), stats.confidence, tokens, editable, threshold, strict
    )


def check_editing_threshold(value) -> Optional[str]:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    if not ok:
        return (
            f"editing_threshold must be in [0, 1] (a committed token is rewritten when the model "
            f"proposes another one with a probability above it) or None to turn editing off, got {value!r}"
        )
    return None


def check_max_post_steps(value) -> Optional[str]:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if not ok:
        return (
            f"max_post_steps must be an integer >= 0 (editing forwards after a block has no masks "
            f"left), got {value!r}"
        )
    return None
