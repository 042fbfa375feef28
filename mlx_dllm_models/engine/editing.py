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
from ..settings_fields import ResolvedSettings


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
        return cls(threshold, settings.max_post_steps or 0, spec.strict_threshold, cand)

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
