"""WeDLM's streaming parallel decoding (github.com/Tencent/WeDLM, wedlm/engine/wedlm_decoder.py and
sampler.py): diffusion decoding on an ordinary causal K/V cache.

A row keeps a window of `block_length` positions (the reference's wedlm_window_size) after its
committed tokens, masks at first. Every step is one forward over the window:

1. the window's committed prefix (its filled positions before the first mask, filled by earlier
   steps) is given as many new masks at the window's end (`_refill_window_masks`);
2. the forward runs with the filled positions ordered before the masks under causal attention
   (topological reordering): every mask sees every filled token, and the committed prefix sees only
   what precedes it, so its K/V are exactly the causal model's and are kept;
3. that prefix leaves the window and is returned (EOS ends the row, as max_tokens does);
4. among the window's masks, those whose entropy plus the position penalty is below
   `entropy_threshold` are filled with their proposals, at least the least of them
   (decoding.wedlm.wedlm_commit). Filled positions are never re-masked.

The reference writes the reordered window into its paged cache; here the window stays in column
order and the forward gets the keep mask that the reordered causal attention implies
(decoding.wedlm.reordered_causal_mask), with RoPE on the columns as the reference's position ids:
the same attention, on mlx-lm's cache protocol. The reference's separate prefill forward is folded
into the first step (the prompt's rows are causal either way).

The rows of a batch step together, one forward a step: each row's K/V sit in its own columns
(its committed tokens from column 0, its window after them), each row writes its step's K/V after
its own committed ones (`RowKVCache`), and the mask hides from each row the columns it has not
written. At temperature 0 a row's tokens are those it gets alone; above it, its draws depend on the
rows it decodes with (one draw over the batch's windows per step). A row leaves the batch (its K/V
rows with it) when it finishes, or before the next step when it is cancelled (`run(cancelled=)`).

Structured output (constrained.WindowConstraint): a constrained row fills only a prefix of its
window, so each of its steps starts from a window of masks right after its committed tokens. Its
first column takes the best token the grammar allows (the logits masked by the allowed set, then
the same draw), the following columns their proposals while the rule above fills them and the
grammar allows each after the tokens before it, then the grammar's forced tokens and EOS fill
the rest of the window without a forward. Rows without a constraint decode as above; above
temperature 0 the constrained rows' draws take a key of their own.
"""

from typing import Iterator, List, Sequence, Type

import mlx.core as mx
import numpy as np

from ..cache import RowKVCache
from ..decoding import token_stats
from ..decoding.constrained import allowed_tokens, mask_logits
from ..decoding.wedlm import committed_prefix, reordered_causal_mask, wedlm_commit
from .base import StepEvent, block_event, check_finite, next_key
from .constrained import WindowConstraint
from .contracts import Backend, Decoder, DecoderInputs, Prompts, Rows, WindowBackend
from .logprobs import entries


def _batch_mask(keeps, widths, length: int, columns: int) -> mx.array:
    """(B, 1, length, columns) keep mask from each row's (rows, its columns) keep mask; the
    padding query rows see column 0 only (their outputs are never read, but a row that sees
    nothing would give NaN)."""
    out = np.zeros((len(keeps), 1, length, columns), dtype=bool)
    for b, (keep, n) in enumerate(zip(keeps, widths)):
        out[b, 0, : keep.shape[0], :n] = keep
        out[b, 0, keep.shape[0] :, 0] = True
    return mx.array(out)


def _rows_of(logits, spans):
    """Each row's window logits: rows lo..hi-1 of its part of the batch's (B, L, V)."""
    return [logits[b, lo:hi] for b, (lo, hi) in enumerate(spans)]


class WindowKV(Backend):
    """`cache="prefix"` (the default): the K/V of committed columns are kept (RowKVCache, written
    in place), and each forward runs over every row's columns after its committed ones only."""

    def __init__(self, model, rows: int, width: int):
        self.model = model
        self.cache = RowKVCache(len(model.layers), rows, width)
        self.committed = [0] * rows

    def logits(self, batch) -> List[mx.array]:
        """Each row's (n - start, V) logits of its columns start..n-1, for `batch` rows (ids: n
        columns, filled: which hold tokens, committed and filled ones; start), under the
        reordered causal mask."""
        news = [ids[lo:] for (ids, _, _), lo in zip(batch, self.committed)]
        length = max(len(n) for n in news)
        x = mx.array([list(n) + [0] * (length - len(n)) for n in news], dtype=mx.int32)
        keeps = [
            np.array(reordered_causal_mask(f, lo)) for (_, f, _), lo in zip(batch, self.committed)
        ]
        widths = [len(ids) for ids, _, _ in batch]
        columns = max(self.committed) + length
        mask = _batch_mask(keeps, widths, length, columns)
        spans = [(start - lo, len(ids) - lo) for (ids, _, start), lo in zip(batch, self.committed)]
        first = min(lo for lo, _ in spans)
        # Every input row's `length` columns go to its own columns from its committed ones on
        # (padding included: those columns are rewritten before any mask lets them be read).
        self.cache.place(self.committed, [lo + length for lo in self.committed], length)
        out = self.model(x, cache=self.cache, mask=mask, head_span=(first, length))
        return _rows_of(out, [(lo - first, hi - first) for lo, hi in spans])

    def commit(self, row: int, column: int):
        """Row `row`'s columns before `column` hold final K/V."""
        self.committed[row] = column

    def select(self, idx: Sequence[int]) -> "WindowKV":
        out = WindowKV.__new__(WindowKV)
        out.model, out.cache = self.model, self.cache.select(idx)
        out.committed = [self.committed[i] for i in idx]
        return out


class WindowRecompute(Backend):
    """`cache="none"`: every forward runs over each whole row (no K/V kept); the same mask."""

    def __init__(self, model, rows: int, width: int):
        self.model = model

    def logits(self, batch) -> List[mx.array]:
        widths = [len(ids) for ids, _, _ in batch]
        length = max(widths)
        x = mx.array([list(ids) + [0] * (length - len(ids)) for ids, _, _ in batch], dtype=mx.int32)
        keeps = [np.array(reordered_causal_mask(f)) for _, f, _ in batch]
        mask = _batch_mask(keeps, widths, length, length)
        first = min(start for _, _, start in batch)
        out = self.model(x, mask=mask, head_span=(first, length))
        return _rows_of(
            out, [(start - first, n - first) for (_, _, start), n in zip(batch, widths)]
        )

    def commit(self, row: int, column: int):
        pass

    def select(self, idx: Sequence[int]) -> "WindowRecompute":
        return self


class _Window:
    """A row's window: its tokens, which are filled, and (with the logprobs setting) each filled
    position's TokenLogprob."""

    def __init__(self, mask_id: int, size: int):
        self.mask_id = mask_id
        self.tokens: List[int] = [mask_id] * size
        self.filled: List[bool] = [False] * size
        self.logprobs: List = [None] * size

    def refill(self):
        """As many new masks at the end as the committed prefix holds (`_refill_window_masks`)."""
        n = committed_prefix(self.filled)
        self.tokens += [self.mask_id] * n
        self.filled += [False] * n
        self.logprobs += [None] * n

    def prune(self):
        """The committed prefix, removed from the window: (tokens, logprobs)."""
        n = committed_prefix(self.filled)
        out = self.tokens[:n], self.logprobs[:n]
        del self.tokens[:n], self.filled[:n], self.logprobs[:n]
        return out


class WeDLMDecoder(Decoder):
    """WeDLM's decoder: the rows of a batch step together, one forward a step (see the module
    docstring). Its family registers it, and names its one rule, in its model file."""

    # Structured output: a constrained row fills a grammar-valid prefix of its window
    # (constrained.WindowConstraint).
    takes_constraints = True
    # `run(cancelled=)` drops a cancelled row before the next step.
    drops_cancelled_rows = True

    def __init__(self, model, inputs: DecoderInputs, backend: Type[WindowBackend]):
        self.model = model
        self.constraints = inputs.constraints  # one structured.Constraint (or None) per prompt
        self.rules = {}  # row -> WindowConstraint, for the constrained rows of a run
        self.spec = inputs.spec
        self.s = settings = inputs.settings
        self.eos = set(int(e) for e in inputs.eos_token_ids)
        self.backend = backend
        self.key = mx.random.split(mx.random.key(settings.seed))[1]
        self.nfe = 0
        self.confidence = {}  # row -> its window's confidence at the last step (step_confidence)

    def _fill(self, logits: List[mx.array], windows: List[_Window], rows: List[int]):
        """Step 4: fill the masks the rule picks in each row's window, from its step's logits
        (one (n, V) array a row, n its window's length); a constrained row (of `rows`, the
        windows' row indices) fills the grammar's prefix instead."""
        s = self.s
        greedy = s.temperature == 0
        width = max(len(w.tokens) for w in windows)
        padded = mx.stack([mx.pad(x, ((0, width - x.shape[0]), (0, 0))) for x in logits])
        # Over every window row: the position penalty counts window columns, filled ones too. The
        # mask id is not suppressed, as in the reference's sampler: the window's flags, not its
        # token values, say what is filled.
        stats = token_stats(
            padded,
            temperature=s.temperature,
            top_k=None if greedy else s.top_k,
            top_p=None if greedy else s.top_p,
            key=None if greedy else next_key(self),
            order=self.spec.sampling_order,
        )
        masked = [[not f for f in w.filled] + [False] * (width - len(w.filled)) for w in windows]
        pick = wedlm_commit(
            stats.entropy, mx.array(masked), s.entropy_threshold, s.pos_penalty_factor
        )
        if self.step_confidence:  # each window's, read before its masks are filled
            self.confidence = dict(zip(rows, stats.confidence.tolist()))
        ruled = [i for i, r in enumerate(rows) if r in self.rules]
        firsts = self._first_draws([logits[i] for i in ruled], [self.rules[rows[i]] for i in ruled])
        firsts = dict(zip(ruled, firsts))
        for i, (window, row_pick, proposals, x) in enumerate(
            zip(windows, pick.tolist(), stats.x0.tolist(), logits)
        ):
            if i in firsts:
                # Its window is all masks (it fills prefixes only, each committed the next step).
                size = len(window.tokens)
                tokens = self.rules[rows[i]].step(firsts[i], proposals[1:size], row_pick[1:size])
                chosen = list(range(len(tokens)))
            else:
                chosen = [k for k, p in enumerate(row_pick) if p]
                tokens = [proposals[k] for k in chosen]
            lps = None
            if s.logprobs is not None:
                lps = entries(x[mx.array(chosen)], tokens, s.logprobs)
            for n, k in enumerate(chosen):
                window.tokens[k] = tokens[n]
                window.filled[k] = True
                window.logprobs[k] = None if lps is None else lps[n]

    def _first_draws(self, logits: List[mx.array], rules: List[WindowConstraint]) -> List[int]:
        """Each constrained row's draw at its window's first column: the family's own draw from
        the logits masked by the grammar's allowed set (a stopped grammar's row: any, EOS comes
        without one)."""
        if not logits:
            return []
        s, vocab = self.s, logits[0].shape[-1]
        words = [r.mask() for r in rules]
        size = next((len(w) for w in words if w is not None), 1)
        words = np.stack([np.zeros(size, np.uint32) if w is None else w for w in words])
        greedy = s.temperature == 0
        masked = mask_logits(
            mx.stack([x[0] for x in logits]), allowed_tokens(mx.array(words), vocab)
        )
        return (
            token_stats(
                masked[:, None, :],
                temperature=s.temperature,
                top_k=None if greedy else s.top_k,
                top_p=None if greedy else s.top_p,
                key=None if greedy else next_key(self),
                suppress_ids=(self.spec.mask_token_id,),
                order=self.spec.sampling_order,
            )
            .x0[:, 0]
            .tolist()
        )

    def _step_event(self, rows, outs, windows) -> StepEvent:
        limit, mask_id = self.s.max_tokens, self.spec.mask_token_id
        canvases = []
        for r in rows:
            canvas = (outs[r] + windows[r].tokens)[:limit]
            canvases.append(canvas + [mask_id] * (limit - len(canvas)))
        block = (min(len(outs[r]) for r in rows), limit)
        conf = None
        if self.step_confidence:
            nan = float("nan")
            conf = []
            for r in rows:
                row = ([nan] * len(outs[r]) + self.confidence[r][: len(windows[r].tokens)])[:limit]
                conf.append(row + [nan] * (limit - len(row)))
            conf = mx.array(conf, dtype=mx.float32)
        return StepEvent(list(rows), mx.array(canvases, dtype=mx.int32), block, self.nfe, conf)

    def run(
        self, prompts: Prompts, *, cancelled: Rows = frozenset(), constraints=None, consumed=None
    ) -> Iterator[object]:
        """Decode `prompts`, one forward a step. `constraints` / `consumed`: each row's
        structured.Constraint (None: unconstrained; default: the decoder's) and the tokens it
        already returned, as MaskedBlockDecoder.run takes them. `cancelled`: a set of row indices
        the caller may grow while the run goes on (between two of its events); a row in it
        leaves the batch before the next step's forward, with no further event, and the other
        rows' tokens are those of a run without it at temperature 0. A run whose rows are all
        cancelled ends."""
        s = self.s
        constraints = self.constraints if constraints is None else constraints
        self.rules = {
            row: WindowConstraint(c, self.eos, s.max_tokens, consumed[row] if consumed else ())
            for row, c in enumerate(constraints or ())
            if c is not None
        }
        size, limit = s.block_length, s.max_tokens
        prompts = [[int(t) for t in p] for p in prompts]
        # A row's window reaches at most 2 * size columns past its committed ones (size, then as
        # many refilled masks as the prefix it commits); the first forward, the prompt and size.
        run = self.backend(self.model, len(prompts), max(map(len, prompts)) + limit + 2 * size)
        windows = [_Window(self.spec.mask_token_id, size) for _ in prompts]
        contexts = [list(p) for p in prompts]  # each row's committed columns
        outs: List[List[int]] = [[] for _ in prompts]
        rows = list(range(len(prompts)))  # the rows still decoding
        while rows:
            keep = [i for i, r in enumerate(rows) if r not in cancelled]
            if not keep:
                return
            if len(keep) < len(rows):  # cancelled rows leave before this step's forward
                run, rows = run.select(keep), [rows[i] for i in keep]
            for r in rows:
                windows[r].refill()
            batch = [
                (
                    contexts[r] + windows[r].tokens,
                    [True] * len(contexts[r]) + windows[r].filled,
                    len(contexts[r]),
                )
                for r in rows
            ]
            logits = run.logits(batch)
            self.nfe += 1
            if self.nfe == 1:  # the run's first forward: corrupt weights show here (one sync)
                check_finite(logits[0], self.model)
            event, pruned = self._commit(run, rows, windows, contexts, outs)
            if event is not None:
                yield event
                done = event_finished(event, rows)
                keep = [i for i, r in enumerate(rows) if not done[i] and r not in cancelled]
                if not keep:
                    return
                if len(keep) < len(rows):
                    run = run.select(keep)
                    rows = [rows[i] for i in keep]
                    logits, pruned = [logits[i] for i in keep], [pruned[i] for i in keep]
            self._fill([x[n:] for x, n in zip(logits, pruned)], [windows[r] for r in rows], rows)
            yield self._step_event(rows, outs, windows)

    def _commit(self, run, rows, windows, contexts, outs):
        """Step 3 over the batch: each row's committed prefix leaves its window; the block event
        of the rows that committed tokens (None when none did), each cut at max_tokens (the
        reference's scheduler stops appending there) and at its first EOS (kept, then cut by
        block_event); and how many tokens each row's window lost."""
        limit = self.s.max_tokens
        with_tokens, tokens, at_limit, logprobs, pruned = [], [], [], [], []
        for i, r in enumerate(rows):
            new, lps = windows[r].prune()
            run.commit(i, len(contexts[r]) + len(new))
            contexts[r] += new
            pruned.append(len(new))
            if not new:
                continue
            new = new[: limit - len(outs[r])]
            cut = next((j + 1 for j, t in enumerate(new) if t in self.eos), len(new))
            new = new[:cut]
            outs[r] += new
            with_tokens.append(r)
            tokens.append(new)
            at_limit.append(len(outs[r]) >= limit)
            logprobs.append(list(lps[: len(new)]))
        if not with_tokens:
            return None, pruned
        lp = logprobs if self.s.logprobs is not None else None
        return block_event(with_tokens, tokens, at_limit, self.eos, self.nfe, lp), pruned


def event_finished(event, rows) -> List[bool]:
    """For each of `rows`, whether `event` finished it (rows the event does not name go on)."""
    done = {r for r, f in zip(event.rows, event.finished) if f}
    return [r in done for r in rows]
