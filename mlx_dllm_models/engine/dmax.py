"""DMax's soft parallel decoding loop (the `dmax` decoder): the authors' dInfer
`BlockDiffusionLLM.naive_batching_generate_uniform` with `BlockDiffusionRunner.decode_uniform` and
`ThresholdParallelDecoder.decode_uniform` (czg1225/DMax, dInfer/python/dinfer/decoding/), at
temperature 0; the rules are decoding/dmax.py's.

A row's canvas is its prompt and masks up to whole blocks of `block_length` on absolute positions;
the prompt's whole blocks are prefilled into a prefix K/V cache. Each block (the first one shares
the prompt's tail) iterates at most `block_length` forwards of the block against that prefix:

1. the first forward reads the block's tokens; every later one reads the previous step's
   embeddings: the prompt's and the masks' own, and at each decoded position the soft mix of its
   token and the mask (decoding.dmax.soft_embeddings);
2. the decoded positions take the step's most probable token, and the masks left of the first one
   proposed below `threshold` are committed (at least the leftmost);
3. the block ends once every decoded position is proposed with probability 0.9 or more, or the
   step changed nothing; a block holding an EOS ends the row.

The K/V of a finished block are those of its final tokens: the next block's first forward runs
over [finished block ; new block] under the block-causal mask and writes them (dInfer's
cross-block update), so each forward is the model's block-causal forward over hard prefix tokens.

The rows of a batch decode as they would alone (the reference's evaluation runs one prompt at a
time; its batched path ends every row's block at the same step): each row has its own cache and
forwards, and the rows take their blocks in turn. One deliberate difference: a prompt shorter than
a block makes the reference prefill one block of masks that nothing reads; that forward is not run
here (one forward fewer than the reference's count).
"""

from typing import Iterator, List, Optional, Sequence

import mlx.core as mx

from ..cache import PrefixKVCache
from ..decoding.dmax import best_tokens, prefix_commit, settled, soft_embeddings
from ..masks import block_causal_mask
from ..settings import SettingsError
from .base import StepEvent, block_event, check_finite
from .contracts import Decoder, DecoderInputs, Prompts, Rows


class _Row:
    """One prompt's canvas, prefix cache and position between its blocks."""

    def __init__(self, decoder: "DMaxDecoder", row: int, prompt: Sequence[int]):
        self.d, self.row = decoder, row
        self.n = len(prompt)
        self.end = self.n + decoder.max_tokens  # the last column it returns, exclusive
        bl = decoder.block_length
        width = -(-self.end // bl) * bl
        mask = decoder.spec.mask_token_id
        self.x = mx.array([list(prompt) + [mask] * (width - self.n)], dtype=mx.int32)
        self.cache = PrefixKVCache(len(decoder.model.layers), width)
        self.first = self.start = self.n // bl * bl  # the first block's column; the open one's
        self.emitted = 0
        if self.start:
            keep = block_causal_mask(self.start, bl)
            decoder.forward(self.x[:, : self.start], self.cache.at(0), keep)
            self.cache.commit(self.start)

    @property
    def done(self) -> bool:
        return self.start >= self.end

    def block(self) -> Iterator[StepEvent]:
        """Decode the open block: a StepEvent per forward; its new tokens are `self.tokens`."""
        d, bl, start = self.d, self.d.block_length, self.start
        stop = start + bl
        tokens = self.x[:, start:stop]
        active = tokens == d.spec.mask_token_id
        embeddings = None
        for step in range(bl):
            if step == 0 and start > self.first:
                logits = self._refresh(start, stop)
            else:
                logits = d.forward(tokens, self.cache.at(start), None, embeddings)
            best, p = best_tokens(logits)
            masks = tokens == d.spec.mask_token_id
            update = prefix_commit(p, masks, d.threshold) | (active & ~masks)
            changed = update & (best != tokens)
            tokens = mx.where(update, best, tokens)
            self.x[:, start:stop] = tokens
            yield self._event(start, stop)
            if settled(p, active, changed):
                break
            own = d.model.embed(tokens)
            soft = active & (tokens != d.spec.mask_token_id)
            embeddings = mx.where(soft[..., None], soft_embeddings(p, own, d.mask_embedding), own)
        lo = max(start, self.n)
        self.tokens = self.x[0, lo : min(stop, self.end)].tolist()
        self.start = stop

    def _refresh(self, start: int, stop: int) -> mx.array:
        """The block's first forward, over [finished block ; block], which writes the finished
        block's final K/V; the block's logits."""
        bl = self.d.block_length
        keep = block_causal_mask(2 * bl, bl, offset=start - bl)
        logits = self.d.forward(self.x[:, start - bl : stop], self.cache.at(start - bl), keep)
        self.cache.commit(start)
        return logits[:, bl:]

    def _event(self, start: int, stop: int) -> StepEvent:
        canvas = self.x[:, self.n : self.end]
        block = (max(start, self.n) - self.n, min(stop, self.end) - self.n)
        return StepEvent([self.row], canvas, block, self.d.nfe)


class DMaxDecoder(Decoder):
    """The `dmax` decoder (see the module docstring)."""

    # The `sampler` setting's names this loop has a rule for: dInfer's ThresholdParallelDecoder.
    samplers = ("threshold",)
    # `run(cancelled=)` drops a cancelled row before its next forward.
    drops_cancelled_rows = True
    # Its own restarts are not implemented: rows never join a running batch.
    judges_joins = True
    # A row draws nothing (temperature 0) and decodes as it would alone: rows of any seeds share
    # a run.
    row_seeds = True

    def __init__(self, model, inputs: DecoderInputs, backend=None):
        s = inputs.settings
        if s.temperature != 0:
            raise SettingsError(
                "the dmax decoder decodes at temperature 0, as DMax's evaluation does (its "
                "sampled path is not transcribed); pass temperature=0"
            )
        self.model, self.spec, self.s = model, inputs.spec, s
        self.block_length, self.threshold = int(s.block_length), float(s.threshold)
        self.max_tokens = int(s.max_tokens)
        self.eos = set(int(e) for e in inputs.eos_token_ids)
        self.mask_embedding = model.embed(mx.array([inputs.spec.mask_token_id]))[0]
        self.nfe = 0
        self.checked = False

    def forward(self, ids, cache, keep, embeddings: Optional[mx.array] = None) -> mx.array:
        """The model's logits of `ids` (or of `embeddings` in their place) against `cache`."""
        logits = self.model(ids, cache=cache, mask=keep, input_embeddings=embeddings)
        self.nfe += 1
        if not self.checked:
            check_finite(logits, self.model)
            self.checked = True
        return logits

    def run(
        self, prompts: Prompts, *, cancelled: Rows = frozenset(), constraints=None, consumed=None
    ) -> Iterator[object]:
        """Decode `prompts`, yielding StepEvents and, per round of blocks, a BlockEvent."""
        rows: List[_Row] = []
        for i, prompt in enumerate(prompts):
            if i not in cancelled:
                rows.append(_Row(self, i, prompt))
        while rows:
            finished, tokens, at_limit = [], [], []
            for row in list(rows):
                for event in row.block():
                    yield event
                    if row.row in cancelled:
                        break
                if row.row in cancelled:
                    rows.remove(row)
                    continue
                row.emitted += len(row.tokens)
                finished.append(row.row)
                tokens.append(row.tokens)
                at_limit.append(row.done)
            if not finished:
                continue
            event = block_event(finished, tokens, at_limit, self.eos, self.nfe)
            yield event
            ended = {r for r, f in zip(event.rows, event.finished) if f}
            rows = [row for row in rows if row.row not in ended]
