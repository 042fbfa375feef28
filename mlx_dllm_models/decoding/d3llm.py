"""d3LLM's multi-block entropy-threshold decoding (hao-ai-lab/d3LLM: `generate_multi_block` of
d3llm/d3llm_LLaDA/d3llm_llada_generate_util.py and `_sample_multi_block` of
d3llm/d3llm_DREAM/d3llm_dream_generate_util.py), the decoder of its distilled LLaDA and Dream
weights, as a commit rule of the masked block engine. Selected with sampler="d3llm".

The reference decodes the whole canvas as blocks of `block_size` positions that run in a pipeline.
At each step, from the masks left before its forward:
* the blocks that exist are those up to the first one less than `block_add_threshold` decoded (a
  block opens the next once that much of it is decoded; one block opens per step, and a block
  that just opened has no decoded position, so this is the reference's counter);
* a block is fully active once the block before it is `decoded_token_threshold` decoded (the
  first block always is);
* every mask of an existing block whose entropy (of the model's own distribution) is below
  `threshold` is committed; if the first fully active block with masks commits nothing, its
  lowest-entropy mask is. LLaDA's form (the spec's `threshold_keeps_lowest`) also commits the
  step's lowest-entropy mask whatever its entropy and keeps the others at entropy <= threshold.
With `early_stop`, once a position holds an EOS, every generated position after the first EOS
becomes that EOS (the model sees them so) and is never decoded: `fill_after_eos`, which the engine
applies after each commit (the rule's `fills_after_eos`).

So every step commits one mask at least, and a block of M masks takes at most M forwards: there is
no step budget (the schedule is all zeros; steps must be at least the masks).

Deviations: the reference leaves a last partial block (max_tokens not a multiple of block_size)
undecoded until its 10,000-forward cap; here it is a shorter last block. Its early stop reads one
EOS id (the tokenizer's); here every EOS id of the request. At temperature > 0, LLaDA's forced
mask takes the argmax token there, here the step's proposal.
"""

import mlx.core as mx

from ..errors import SettingsError
from .rule import CommitRule


def block_ids(generated: mx.array, size: int) -> mx.array:
    """(B, L) int32: the d3LLM block of each generated column of the window, counted from the
    row's first generated column (0 for the first block); -1 elsewhere."""
    index = mx.cumsum(generated.astype(mx.int32), axis=-1) - 1
    return mx.where(generated, index // size, -1)


def block_progress(cand: mx.array, blocks: mx.array, count: int):
    """(masks, progress), each (B, count): the masks left in each block and the share of its
    positions decoded (1 for a block with no position)."""
    onehot = blocks[..., None] == mx.arange(count)
    masks = (onehot & cand[..., None]).sum(axis=1)
    sizes = onehot.sum(axis=1)
    progress = mx.where(sizes > 0, 1.0 - masks / mx.maximum(sizes, 1), 1.0)
    return masks, progress


def d3llm_select(entropy, cand, generated, settings, keeps_lowest: bool) -> mx.array:
    """(B, L) bool: the masks the step commits (see the module's docstring)."""
    size = settings.block_size
    blocks = block_ids(generated, size)
    count = -(-generated.shape[-1] // size)
    masks, progress = block_progress(cand, blocks, count)
    # A block opens the next once passed; the blocks that exist run to the first one not passed.
    passed = (progress >= settings.block_add_threshold) | (masks == 0)
    before = mx.cumsum((~passed).astype(mx.int32), axis=-1) - (~passed).astype(mx.int32)
    exists = before == 0
    previous = mx.concatenate([mx.ones_like(progress[:, :1]), progress[:, :-1]], axis=-1)
    active = previous >= settings.decoded_token_threshold
    in_use = mx.take_along_axis(exists, mx.maximum(blocks, 0), axis=-1) & cand
    h = mx.where(in_use, entropy, mx.inf)
    thr = settings.threshold
    hit = in_use & ((h <= thr) if keeps_lowest else (h < thr))
    if keeps_lowest:  # LLaDA's topk: the lowest-entropy candidate is always taken
        lowest = mx.arange(h.shape[-1]) == mx.argmin(h, axis=-1, keepdims=True)
        hit = hit | (lowest & in_use)
    # The first fully active block with masks commits one mask at least: its lowest-entropy one.
    first = exists & active & (masks > 0)
    has_first = first.any(axis=-1, keepdims=True)
    in_first = blocks == mx.argmax(first, axis=-1, keepdims=True)
    h_first = mx.where(in_use & in_first, entropy, mx.inf)
    forced = mx.arange(h.shape[-1]) == mx.argmin(h_first, axis=-1, keepdims=True)
    need = has_first & ~(hit & in_first).any(axis=-1, keepdims=True)
    return hit | (forced & need & in_use & in_first)


def fill_after_eos(block: mx.array, generated: mx.array, eos) -> mx.array:
    """d3LLM's early stop (handle_early_stop): every generated position after a row's first EOS
    becomes that EOS (masks included, so they are never decoded)."""
    is_eos = mx.zeros(block.shape, dtype=mx.bool_)
    for e in eos:
        is_eos = is_eos | (block == e)
    is_eos = is_eos & generated
    first = mx.argmax(is_eos, axis=-1, keepdims=True)
    token = mx.take_along_axis(block, first, axis=-1)
    after = (mx.arange(block.shape[-1]) > first) & is_eos.any(axis=-1, keepdims=True)
    return mx.where(after & generated, token, block)


def d3llm_commit(stats, cand, ctx):
    """Commit rule of sampler "d3llm"."""
    return d3llm_select(
        stats.entropy, cand, ctx.generated, ctx.settings, ctx.spec.threshold_keeps_lowest
    )


def d3llm_schedule(masks: mx.array, steps: int, settings) -> mx.array:
    """No floor: every step commits one mask at least, so a block ends within its mask count of
    steps, which `steps` must allow."""
    most = int(masks.max().item())
    if steps < most:
        raise SettingsError(
            f"steps={steps}: the d3llm sampler has no step budget (each step commits one mask at "
            f"least, up to {most}); leave steps unset"
        )
    return mx.zeros((masks.shape[0], 1), mx.int32)


d3llm_commit = CommitRule(
    d3llm_commit,
    schedule=d3llm_schedule,
    fills_after_eos=lambda settings: bool(settings.early_stop),
)
