"""Causal-prefix decoding (Nemotron-Labs-Diffusion): AR-seeded diffusion blocks over a causal KV
prefix. The forwards here (a KV cache, or full recompute) also serve self-speculation
(self_spec.py), whose batched rows keep different numbers of tokens each round and so sit at
columns of their own (`row_forwards`: cache.RowKVCache, masks.rows_prefix_mask).

Diffusion mode (the HF remote code's `generate` with causal_context=True): a causal prefill of the
prompt fills the KV cache and gives the AR head's next token, which seeds position 0 of the first
block; the rest of the block is denoised bidirectionally against the cache, which it reads but never
extends; then one causal forward over the finished block writes its K/V and gives the next block's
seed. That forward runs when the next block begins, so none is spent after the last block or after
every row met an EOS. The cache (cache.PrefixKVCache) is preallocated: every forward writes its K/V
in place and reads the prefix as a slice, never a per-step concatenation.

`cache="none"` is the same decoding by full recompute (each forward over the whole sequence under
masks.causal_prefix_mask), the exact reference mode that the cache must reproduce token for token.

The two options of NVIDIA's `generate_with_prefix_cache_block_diff` (chat_utils.py), settings of this
backend:
- `causal_context=False`: the prompt is encoded bidirectionally (no AR seed: a block starts as masks
  only), and each finished block's K/V are written by a forward over the block attending to the
  prefix and bidirectionally to itself; full recompute runs the same attention as one mask
  (masks.prompt_block_mask). The K/V of a bidirectional prompt depend on all of it, so a chat turn
  reuses none (kv_prefix is None).
- `max_thinking_tokens` / `end_think_token_id`: when a block begins (after its seed is placed), a
  row that has no end_think_token_id among its earlier blocks' tokens, and whose block reaches past
  the budget, gets the marker at new-token position max(max_thinking_tokens, the block's first):
  a decided token, so the block's quota schedule counts the masks without it and nothing
  overwrites it (it replaces the seed when it falls on the block's first position).
"""

from typing import List, Optional

import mlx.core as mx

from ..cache import Positions, PrefixKVCache, PriorKV, RowKVCache
from ..decoding.logprobs import log_probs
from ..masks import causal_prefix_mask, prompt_block_mask, rows_prefix_mask
from .base import next_key, replaced, sample_tokens
from .contracts import Backend


class _Forwards:
    """Forwards over columns start..stop-1 of a (B, W) token array whose queries before `split`
    attend causally and whose queries from `split` on attend to every key before stop (a causal
    part, then a bidirectional window); subclasses differ in how (a KV cache, or full recompute).
    `causal` leaves the K/V of its columns final; `keep(column)` says which K/V are final after a
    forward whose causal part was only partly kept.

    `segments` (prompt_end, block_length), with causal_context=False: the columns before the
    window's first attend per segment (the prompt, then each block: masks.prompt_block_mask), not
    causally; `encode` makes the K/V of a finished segment final."""

    def causal(self, x, start, stop, head_span=None):
        out = self.mixed(x, start, stop, stop, head_span)
        self.keep(stop)
        return out

    def bidirectional(self, x, start, stop):
        return self.mixed(x, start, start, stop)


class _KVForwards(_Forwards):
    def __init__(self, model, width, pads, segments=None):
        # The cache holds each segment's K/V as `encode` wrote them: no mask needs `segments`.
        self.model, self.pads = model, pads
        self.cache = PrefixKVCache(len(model.layers), width, pads)

    def encode(self, x, start, stop) -> bool:
        """Write the final K/V of columns start..stop-1, attending to the final K/V before them and
        bidirectionally to each other (the reference's use_cache=True, use_causal_mask=False
        forward); no logits are read. Returns whether a forward ran."""
        self.mixed(x, start, start, stop, head_span=(stop - start - 1, stop - start))
        self.keep(stop)
        return True

    def mixed(self, x, start, split, stop, head_span=None):
        if self.pads is not None or start < split < stop:
            mask = causal_prefix_mask(stop - start, split, offset=start, left_padding=self.pads)
        else:
            # With this package's cache, no mask attends to every key.
            mask = "causal" if split == stop else None
        return self.model(
            x[:, start:stop], cache=self.cache.at(start), mask=mask, head_span=head_span
        )

    def keep(self, column):
        # A causal part wrote K/V past what was kept: those columns are rewritten later.
        self.cache.committed = column

    def select(self, idx, pads):
        return replaced(self, pads=pads, cache=self.cache.select(idx, pads))


class _RecomputeForwards(_Forwards):
    def __init__(self, model, width, pads, segments=None):
        self.model, self.pads, self.segments = model, pads, segments
        self.positions = Positions.for_left_padding(pads or [0], len(model.layers))

    def encode(self, x, start, stop) -> bool:
        return False  # every forward recomputes the segments under prompt_block_mask

    def mixed(self, x, start, split, stop, head_span=None):
        if self.segments is None:
            mask = causal_prefix_mask(stop, split, left_padding=self.pads)
        else:
            # The window [split, stop) is the open block: its own segment.
            mask = prompt_block_mask(stop, *self.segments, left_padding=self.pads)
        span = (start, stop) if head_span is None else (start + head_span[0], start + head_span[1])
        return self.model(x[:, :stop], cache=self.positions, mask=mask, head_span=span)

    def keep(self, column):
        pass

    def select(self, idx, pads):
        return type(self)(self.model, 0, pads, self.segments)


def _padded(rows) -> mx.array:
    """Token lists of different lengths as one (B, L) array, right-padded with 0 (never read)."""
    length = max(len(r) for r in rows)
    return mx.array([list(r) + [0] * (length - len(r)) for r in rows], dtype=mx.int32)


def _rows_of(logits, heads, first):
    """Row b's logits at its rows heads[b] (forward rows, `first` the head span's first)."""
    return [logits[b, lo - first : hi - first] for b, (lo, hi) in enumerate(heads)]


class _RowKVForwards:
    """Forwards of a batch whose rows keep different numbers of tokens (self-speculation): each
    row's tokens sit in columns of its own from column 0, no left padding. `mixed(ids, starts,
    splits, heads)`: one forward over columns starts[b]..len(ids[b])-1 of every row b (`ids[b]`
    its tokens up to its forward's last column), causal before splits[b] and bidirectional from
    it (masks.rows_prefix_mask); returns row b's logits at its forward rows heads[b] (counted
    from starts[b]). Columns before starts[b] hold final K/V; a later forward of the row starts at
    or before its last kept column, so what a forward wrote past it is rewritten before it is
    read."""

    def __init__(self, model, rows: int, width: int):
        self.model = model
        self.cache = RowKVCache(len(model.layers), rows, width)

    def mixed(self, ids, starts, splits, heads):
        news = [row[start:] for row, start in zip(ids, starts)]
        x, stops = _padded(news), [len(row) for row in ids]
        cache = self.cache.place(starts, stops, x.shape[1])
        if len(ids) == 1 and splits[0] in (starts[0], stops[0]):
            # One row reads no padding: SDPA's own modes, no mask to build (as _KVForwards).
            mask = None if splits[0] == starts[0] else "causal"
        else:
            mask = rows_prefix_mask(starts, splits, stops, x.shape[1])
        span = (min(lo for lo, _ in heads), max(hi for _, hi in heads))
        return _rows_of(self.model(x, cache=cache, mask=mask, head_span=span), heads, span[0])

    def select(self, idx):
        return replaced(self, cache=self.cache.select(idx))


class _RowRecomputeForwards:
    """`_RowKVForwards` by full recompute: each forward runs over every row's columns from 0."""

    def __init__(self, model, rows: int, width: int):
        self.model = model

    def mixed(self, ids, starts, splits, heads):
        x, stops = _padded(ids), [len(row) for row in ids]
        mask = rows_prefix_mask([0] * len(ids), splits, stops, x.shape[1])
        heads = [(start + lo, start + hi) for start, (lo, hi) in zip(starts, heads)]
        span = (min(lo for lo, _ in heads), max(hi for _, hi in heads))
        return _rows_of(self.model(x, mask=mask, head_span=span), heads, span[0])

    def select(self, idx):
        return self


class CausalPrefixCache(Backend):
    """Backend of the masked block engine (see full_recompute.py for the interface): blocks seeded
    by the AR head and denoised against a causal KV prefix."""

    forwards = _KVForwards
    # Self-speculation's batched forwards (each row at columns of its own)
    row_forwards = _RowKVForwards
    # A denoising forward reads the cache and never extends it: it may run on `select(layout,
    # rows)` for the rows that still have masks (the block's final K/V come from its own forward).
    row_steps = True
    join_reencodes = True
    resumes = True
    # The AR head's block seeds are drawn from one key for the batch (sample_tokens): rows of
    # different seeds cannot share a run and each keep its own draws.
    draws_batch_wide = True

    @classmethod
    def joins_exactly(cls, settings) -> bool:
        """Whether a restart over [prompt ; committed] (the server's joins) reproduces the run:
        its causal prefill writes the K/V and AR seed the per-block forwards would have only when
        every block is whole (blocks are counted from the prompt's end and attend within the
        block: a partial last block would see a longer row's columns). With causal_context=False
        the restart would encode the committed blocks with the prompt (not block by block), and a
        thinking budget would be counted from the restart."""
        return (
            settings.max_tokens % settings.block_length == 0
            and settings.causal_context is not False
            and settings.end_think_token_id is None
        )

    def __init__(self, model, spec, layout, settings):
        if layout.aligned or len(set(layout.starts)) != 1:
            raise ValueError("causal-prefix decoding needs blocks counted from the prompts' end")
        self.model, self.spec, self.settings = model, spec, settings
        self.pads = list(layout.pads) if any(layout.pads) else None
        self.prompt_end = layout.starts[0]
        self.causal_context = settings.causal_context is not False  # True: the default
        segments = None if self.causal_context else (self.prompt_end, settings.block_length)
        self.fwd = self.forwards(model, layout.width, self.pads, segments)
        # The thinking budget (both set or neither: the settings table's `requires`).
        self.end_think = settings.end_think_token_id
        self.max_thinking = settings.max_thinking_tokens
        self.generated = layout.generated
        self.key = mx.random.split(mx.random.key(settings.seed))[1]
        self.seed = None  # (B,) the AR head's token for the next block's first position
        # (B, V) the AR head's log-probabilities there, with the logprobs setting (masked.py reads
        # them as that position's, which no denoising step decides)
        self.seed_log_probs = None
        self.pending = None  # the finished block whose causal forward has not run yet
        self.reused = 0  # prompt columns whose K/V came from an earlier run (resume)
        self.nfe = 0

    def _seed_after(self, x, start, stop):
        self.nfe += 1
        logits = self.fwd.causal(x, start, stop, head_span=(stop - start - 1, stop - start))
        self.seed = sample_tokens(logits[:, -1], self.settings, self.spec, next_key(self))
        if self.settings.logprobs is not None:
            self.seed_log_probs = log_probs(logits[:, -1])

    def _encode(self, x, start, stop):
        self.nfe += self.fwd.encode(x, start, stop)

    def _context_after(self, x, start, stop):
        """Make the K/V of columns start..stop-1 (the prompt, or a finished block) final: a causal
        forward whose last logit seeds the next block, or (causal_context=False) a bidirectional
        encoding of the segment and no seed."""
        if self.causal_context:
            self._seed_after(x, start, stop)
        else:
            self._encode(x, start, stop)

    def prefill(self, x):
        self._context_after(x, 0, self.prompt_end)

    def resume(self, x, prior: PriorKV):
        """prefill, reusing `prior`'s K/V over the prefix the prompt shares with it (causal K/V
        depend on the tokens up to their own only); the prompt's last token is always computed,
        for the AR head's seed of the first block."""
        if not self.causal_context:
            # A bidirectional prompt's K/V depend on all of it: none of an earlier run's carry over.
            self.prefill(x)
            return
        prior.check("causal")
        keep = prior.shared(x[0].tolist(), 1, limit=self.prompt_end - 1)
        self.fwd.cache = prior.cache_for(self.fwd.cache.width, keep)
        self.reused = keep
        self._seed_after(x, keep, self.prompt_end)

    def kv_prefix(self, x) -> Optional[PriorKV]:
        if not self.causal_context:
            return None  # see resume
        committed = self.fwd.cache.committed
        return PriorKV(x[0, :committed].tolist(), self.fwd.cache, "causal")

    @classmethod
    def kv_kind(cls, settings) -> Optional[str]:
        """The PriorKV.kind a run under these settings leaves (kv_prefix) and can resume from;
        None: it leaves nothing reusable (a bidirectional prompt, see resume)."""
        return "causal" if settings.causal_context is not False else None

    def begin_block(self, x, start, stop):
        if self.pending is not None:
            self._context_after(x, *self.pending)
            self.pending = None
        if self.causal_context:
            x[:, start] = mx.where(self.generated[:, start], self.seed, x[:, start])
        if self.end_think is not None:
            self._end_thinking(x, start, stop)
        return x

    def _end_thinking(self, x, start, stop):
        """generate_with_prefix_cache_block_diff's thinking budget: rows with no end_think token
        in their earlier blocks get it at new-token position max(max_thinking_tokens, the block's
        first), when that falls in this block. Every row's new tokens start at prompt_end."""
        before = start - self.prompt_end  # new tokens of the earlier blocks
        column = start + max(0, self.max_thinking - before)
        if column >= stop:
            return
        put = self.generated[:, column]
        if before:
            put = put & ~(x[:, self.prompt_end : start] == self.end_think).any(axis=1)
        x[:, column] = mx.where(put, self.end_think, x[:, column])

    def block_logits(self, x, start, stop):
        self.nfe += 1
        return self.fwd.bidirectional(x, start, stop)

    def end_block(self, x, start, stop):
        self.pending = (start, stop)

    def select(self, layout, idx: List[int]):
        pads = list(layout.pads) if any(layout.pads) else None
        return replaced(
            self,
            pads=pads,
            fwd=self.fwd.select(idx, pads),
            generated=layout.generated,
            seed=None if self.seed is None else self.seed[mx.array(idx)],
            seed_log_probs=None
            if self.seed_log_probs is None
            else self.seed_log_probs[mx.array(idx)],
        )


class CausalPrefixRecompute(CausalPrefixCache):
    """The same decoding by full recompute: the reference mode the cache must reproduce."""

    forwards = _RecomputeForwards
    row_forwards = _RowRecomputeForwards
    # No K/V to keep or reuse: every forward recomputes the whole sequence.
    resumes = False

    @classmethod
    def kv_kind(cls, settings):
        return None

    def kv_prefix(self, x) -> Optional[PriorKV]:
        return None
