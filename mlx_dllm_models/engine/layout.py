"""Where each row's prompt and canvas sit in the (B, W) token array of a masked block decoding run;
the decoder and every backend read it."""

from typing import List, Sequence, Union

import mlx.core as mx

from ..decoding import block_ranges
from .base import replaced


class Layout:
    """Where each row's prompt and canvas sit in the (B, W) token array.

    Rows are left-padded; a row's positions count its real tokens only (column - pad). For
    bidirectional families every canvas starts at the same column. For block-causal families,
    whose blocks sit on absolute positions 0, B, 2B, ..., each row's padding is a multiple of the
    block length, so that block boundaries fall on the same columns for every row; canvases then
    start at different columns, and the array extends to the end of the last block.

    `generated` marks the columns a row returns (its max_tokens positions); `decoded` the columns
    it decodes. They differ for block-causal families only: there a row decodes every position of
    its last block, past max_tokens included, and the output is cut afterwards, as SDAR's
    block_diffusion_generate and LLaDA2's generate do (their last block is a full block of masks,
    and its quota schedule and threshold steps count all of them), so tokens match the references
    whatever max_tokens is.

    `prompt_end` (block-causal, dllm's BD3LM): every row's prompt ends on the same block boundary
    (its padding is what fills the longest prompt up to whole blocks) and blocks are counted on
    columns; the array ends at the last generated column and rows decode their max_tokens only.

    `cut_last_block` (block-causal, Stable-DiffCoder): blocks on absolute positions, but the array
    ends at the last generated column and rows decode their max_tokens only; a row whose canvas
    ends before the array's never attends the columns after its end (`right_ends`), as alone it
    has none.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        n_gen: Union[int, Sequence[int]],
        block_length: int,
        aligned: bool,
        mask_id: int,
        pad_id: int = 0,
        suffix: Sequence[int] = (),
        prompt_end: bool = False,
        cut_last_block: bool = False,
    ):
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        self.prompt_end = prompt_end = aligned and prompt_end
        if prompt_end:
            self.pads = [block_length * -(-longest // block_length) - n for n in lengths]
        elif aligned:
            self.pads = [block_length * -(-(longest - n) // block_length) for n in lengths]
        else:
            self.pads = [longest - n for n in lengths]
        self.starts = [p + n for p, n in zip(self.pads, lengths)]
        # Each row's budget of new tokens: one for all, or one per row (the server's rows that
        # joined a batch with part of their tokens already committed, see server.py).
        n_gens = [n_gen] * len(prompts) if isinstance(n_gen, int) else [int(n) for n in n_gen]
        self.n_gens = n_gens
        self.n_gen = max(n_gens)
        # Infilling (bidirectional families only): each row's canvas is followed by `suffix`.
        suffix = list(suffix)
        self.suffix_length = len(suffix)
        width = max(s + n for s, n in zip(self.starts, n_gens)) + len(suffix)
        whole_last_block = aligned and not prompt_end and not cut_last_block
        if whole_last_block:
            width = block_length * -(-width // block_length)
        self.width = width
        self.aligned = aligned
        self.block_length = block_length
        rows = [
            [pad_id] * pad
            + list(p)
            + [mask_id] * n
            + suffix
            + [mask_id] * (width - pad - len(p) - n - len(suffix))
            for pad, p, n in zip(self.pads, prompts, n_gens)
        ]
        self.tokens = mx.array(rows, dtype=mx.int32)
        cols = mx.arange(width)[None, :]
        starts = mx.array(self.starts)[:, None]
        self.ends = [s + n for s, n in zip(self.starts, n_gens)]  # past each row's last column
        # `cut_last_block`: each row's end where some row ends before the array does (a column
        # past it, which the row's last block would see, is never attended); else None.
        cut = aligned and cut_last_block and not prompt_end and min(self.ends) < width
        self.right_ends = list(self.ends) if cut else None
        self.generated = (cols >= starts) & (cols < mx.array(self.ends)[:, None])  # (B, W)
        if whole_last_block:
            ends = mx.array([block_length * -(-e // block_length) for e in self.ends])
            self.decoded = (cols >= starts) & (cols < ends[:, None])
        else:
            self.decoded = self.generated
        real = cols >= mx.array(self.pads)[:, None]
        # The tokens a row was given (prompt, suffix; not padding): classifier-free guidance's
        # unconditional row masks them.
        self.given = real & (self.tokens != mask_id)
        # Masks inside a prompt (infilling): decoded too, as LLaDA's and Dream's references do.
        self.infill = real & (self.tokens == mask_id) & (cols < starts)
        self.has_infill = bool(self.infill.any().item())

    def window_start(self, x, mask_id: int, start: int) -> int:
        """The first column of a block's candidate window: `start`, or the first mask still left
        inside a prompt (every mask before a block's end is a candidate, as in LLaDA's
        generate.py; Dream decodes its whole canvas as one block)."""
        if not self.has_infill:
            return start
        left = self.infill[:, :start] & (x[:, :start] == mask_id)
        if not left.any().item():
            return start
        return int(mx.argmax(left.any(axis=0)).item())

    def blocks(self):
        first = min(self.starts)
        # Aligned: up to the end of the last block, whose positions past max_tokens are decoded.
        end = self.width if self.aligned else max(self.ends)
        return block_ranges(first, end - first, self.block_length, aligned=self.aligned)

    def select(self, idx: List[int]):
        return replaced(
            self,
            pads=[self.pads[i] for i in idx],
            starts=[self.starts[i] for i in idx],
            n_gens=[self.n_gens[i] for i in idx],
            ends=[self.ends[i] for i in idx],
            right_ends=None if self.right_ends is None else [self.right_ends[i] for i in idx],
            generated=self.generated[mx.array(idx)],
            decoded=self.decoded[mx.array(idx)],
            given=self.given[mx.array(idx)],
            infill=self.infill[mx.array(idx)],
        )
