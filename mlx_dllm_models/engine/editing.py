"""Token editing (LLaDA2.1 T2T) over one block of masked block decoding, for the families that
declare its settings (`editing_threshold`, `max_post_steps`).

Committed, generated positions of the open block are rewritten when the model proposes another
token above editing_threshold, during the block's steps and then for up to max_post_steps more
forwards once the block has no masks left. A row stops at a step that edits nothing, and, once it
has no masks left, at a step that brings its block back to a state it held before (edits
flip-flopping between tokens: more forwards would only cycle); it keeps that state.
"""

from typing import Optional

import mlx.core as mx

from ..decoding.block import token_edits
from ..decoding.levenshtein import apply_edit_ops, levenshtein_fill, transfer_floor
from ..decoding.stats import without
from ..settings_fields import ResolvedSettings

# `_joint_decode_block`'s max_steps_per_block: the forwards one block may take (LLaDA2.2).
MAX_STEPS_PER_BLOCK = 1000


def _revisited(seen, block, cand) -> mx.array:
    """(B,) bool: rows whose block, with no masks left, is in a state they held before (recorded
    in `seen`, one set of states per row). LLaDA2.1's editing would cycle from there."""
    out = []
    for states, tokens, masked in zip(seen, block.tolist(), cand.any(axis=1).tolist()):
        state = tuple(tokens)
        out.append(not masked and state in states)
        if not masked:
            states.add(state)
    return mx.array(out)


class BlockEditing:
    """Which rows of the open block still iterate, and what a step rewrites. The engine calls
    `continues` before a step's forward, `edits` with its statistics, `settle` after its commit."""

    def __init__(self, threshold: float, max_post: int, strict: bool, cand: mx.array):
        self.threshold, self.max_post, self.strict = threshold, max_post, strict
        self.active = cand.any(axis=1)  # (B,) rows still iterating on this block
        self.post = mx.zeros((cand.shape[0],), mx.int32)  # (B,) forwards since its last mask
        self.seen = [set() for _ in range(cand.shape[0])]  # each row's maskless block states
        self.masked = None  # (B,) rows with masks at the current step's start

    @classmethod
    def open(cls, settings: ResolvedSettings, spec, cand: mx.array) -> Optional["BlockEditing"]:
        """The editing of a block whose candidates are `cand`; None when editing is off."""
        threshold = settings.editing_threshold
        if threshold is None:
            return None
        max_post = settings.max_post_steps or 0
        if spec.edit_token_ids:
            return LevenshteinEditing(threshold, max_post, spec, cand, settings)
        return cls(threshold, max_post, spec.strict_threshold, cand)

    def step_bound(self, steps: int) -> int:
        """The most steps the block may take."""
        return steps + self.max_post

    def suppressed(self, ids: tuple) -> tuple:
        """The ids the step's statistics never propose, given the family's."""
        return ids

    def revise(self, stats, logits, commit, x0, edits):
        """(commit, x0) of the step once its edits are known: 2.1 adds the edits."""
        return commit | edits, x0

    def apply(self, block, current, gen):
        """The block after the step's writes: 2.1 writes are final."""
        return block

    def continues(self, cand: mx.array) -> bool:
        """Before a step: count it against each maskless row's max_post_steps; whether any row
        still iterates (a host read)."""
        self.masked = cand.any(axis=1)
        self.post = self.post + (self.active & ~self.masked)
        self.active = self.active & (self.post <= self.max_post)
        return self.active.any().item()

    def edits(self, stats, current: mx.array, gen: mx.array, mask_id: int) -> mx.array:
        """(B, L) the committed positions of the window `current` that this step rewrites; a row
        that had no masks left at the step's start and edits nothing stops."""
        editable = gen & (current != mask_id) & self.active[:, None]
        edits = token_edits(stats, current, editable, self.threshold, self.strict)
        self.active = self.active & (self.masked | edits.any(axis=1))
        return edits

    def select(self, keep) -> None:
        """The rows `keep` only (the others left the batch mid-block)."""
        idx = mx.array(keep)
        self.active, self.post = self.active[idx], self.post[idx]
        self.seen = [self.seen[i] for i in keep]
        if self.masked is not None:
            self.masked = self.masked[idx]

    def settle(self, block: mx.array, cand: mx.array) -> None:
        """After the step's commit: a maskless row back in a state it held before stops."""
        self.active = self.active & ~_revisited(self.seen, block, cand)


class LevenshteinEditing(BlockEditing):
    """LLaDA2.2's editing (`_joint_decode_block`): 2.1's T2T may also propose DELETE / SPLIT,
    consumed after each step's writes (decoding.levenshtein.apply_edit_ops), so masks come back.

    Per row: `original` marks the block's original masks, `initial` their count at the block's
    start, `step` the steps taken. A step fills the transfer schedule's share of `initial` plus
    every new mask (all masks once `step` reaches `steps`); `post` counts the steps begun with no
    original mask left (0 while any is). A row stops before a step begun with no mask and `post`
    above max_post_steps, after a step begun with no mask that edits nothing (the block is stable),
    or at MAX_STEPS_PER_BLOCK. Its final round (the step after which the budget stops it, or
    the last allowed step) fills every mask and proposes no DELETE / SPLIT, so the block ends
    resolved."""

    def __init__(self, threshold, max_post, spec, cand, settings):
        super().__init__(threshold, max_post, spec.strict_threshold, cand)
        self.edit_ids = tuple(spec.edit_token_ids)
        self.mask_id = spec.mask_token_id
        self.fill_threshold, self.steps = settings.threshold, settings.steps
        n = cand.shape[0]
        self.original = cand
        self.initial = cand.astype(mx.int32).sum(axis=1)
        self.step = mx.zeros((n,), mx.int32)
        self.final = mx.zeros((n,), mx.bool_)
        self.cand = cand

    def step_bound(self, steps: int) -> int:
        return MAX_STEPS_PER_BLOCK

    def suppressed(self, ids: tuple) -> tuple:
        return tuple(i for i in ids if i not in self.edit_ids)

    def continues(self, cand: mx.array) -> bool:
        self.cand, self.masked = cand, cand.any(axis=1)
        self.post = mx.where((cand & self.original).any(axis=1), 0, self.post + 1)
        spent = ~self.masked & (self.post > self.max_post)
        self.active = self.active & ~spent & (self.step < MAX_STEPS_PER_BLOCK)
        return self.active.any().item()

    def revise(self, stats, logits, commit, x0, edits):
        cand = self.cand
        new = (cand & ~self.original).astype(mx.int32).sum(axis=1)
        need = transfer_floor(self.initial, self.steps, self.step) + new
        fill = levenshtein_fill(stats.confidence, cand, self.fill_threshold, need, self.strict)
        fill = mx.where((self.step >= self.steps)[:, None], cand, fill)
        # The final round is the step after which the loop stops for the budget: no original
        # mask left once it fills, and the next step's post count above max_post_steps.
        originals_left = (cand & self.original & ~fill).any(axis=1)
        budget = ~originals_left & (self.post + 1 > self.max_post)
        self.final = self.active & (budget | (self.step >= MAX_STEPS_PER_BLOCK - 1))
        fill = mx.where(self.final[:, None], cand, fill) & self.active[:, None]
        x0 = x0.astype(mx.int32)
        proposed_edit = (x0 == self.edit_ids[0]) | (x0 == self.edit_ids[1])
        alt = mx.argmax(without(logits, (self.mask_id, *self.edit_ids)), axis=-1)
        x0 = mx.where(self.final[:, None] & proposed_edit, alt.astype(mx.int32), x0)
        self.step = self.step + self.active.astype(mx.int32)
        return fill | edits, x0

    def apply(self, block, current, gen):
        delete_id, split_id = self.edit_ids
        moved = gen & self.active[:, None]
        block, self.original = apply_edit_ops(
            block, current, self.original, moved, self.mask_id, delete_id, split_id
        )
        return block

    def select(self, keep) -> None:
        super().select(keep)
        idx = mx.array(keep)
        self.original, self.initial = self.original[idx], self.initial[idx]
        self.step, self.final, self.cand = self.step[idx], self.final[idx], self.cand[idx]

    def settle(self, block: mx.array, cand: mx.array) -> None:
        """No revisit stop: the reference escapes a repeated state by resampling instead (not
        reproduced); a cycle ends with the max_post_steps budget or MAX_STEPS_PER_BLOCK."""
