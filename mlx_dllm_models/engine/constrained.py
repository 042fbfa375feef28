"""Structured output in the loops: one llguidance matcher per row (structured.py builds them) and
what each decoder commits under it; the rule is decoding/constrained.py's.

- RowConstraints, the masked block loop (engine/masked.py): the loop calls `open_block` after the
  backend began a block (tokens a backend put there, such as Nemotron's AR-seeded first column,
  stay only where the grammar allows them; forced tokens are filled), `commit` after each step's
  rule (a constrained row's commit is replaced by the rule's left-to-right prefix) and `select`
  when rows leave. Rows without a constraint are untouched. Host work: one read of the block's
  window at `open_block`, and per step one read of the rows' first tokens, proposals and rule
  commits (the grammar's mask is computed on the host while the device evaluates the forward);
  everything a constrained row commits is decided on the host, so its window is known there.
- TokenSequenceConstraint, self-speculation (engine/self_spec.py): verified positions' logits
  masked by the grammar, forced tokens as the next round's first drafts.
- CanvasConstraint, DiffusionGemma's canvas (engine/canvas.py): the canvas's readout.
- WindowConstraint, WeDLM's window (engine/wedlm.py): the window's left-to-right fill.

All four keep a row's text closable within its budget (BudgetGuard, decoding.constrained's
`completion`).
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..decoding import token_stats
from ..decoding.constrained import allowed_tokens, commit_prefix, completion, mask_logits


@dataclass
class _Row:
    """A constrained row's open block, on the host."""

    window: List[int]  # the window's tokens
    open: List[int]  # window columns the row returns and has not committed yet, left to right
    tail: List[int] = field(default_factory=list)  # columns decoded but never returned
    after: int = 0  # columns the row returns after the window (its budget beyond this block)

    @property
    def room(self) -> int:
        """Positions left for the row's text and its EOS."""
        return len(self.open) + self.after


# The budget guard searches for a closing only when a row's room is within this many positions of
# the last closing it found (a search costs a few hundred microseconds at a 128k vocabulary, a
# token's mask tens): a token that lengthens the closing by more than this between two searches
# could still leave a row without room to close (it ends with finish_reason "length").
GUARD_SLACK = 32


class BudgetGuard:
    """Whether a row's grammar can still be closed, and EOS follow, within the positions left."""

    def __init__(self, matcher, candidates):
        self.matcher, self.candidates = matcher, candidates
        self.need = None  # the length of the last closing found

    def fits(self, left: int) -> bool:
        if self.need is not None and left - 1 > self.need + GUARD_SLACK:
            return True
        path = completion(self.matcher, left - 1, self.candidates)
        if path is None:
            return False
        self.need = len(path)
        return True


class RowConstraints:
    """The matchers of a run's rows (None: unconstrained) and their open blocks."""

    def __init__(
        self, matchers: Sequence, candidates: Sequence[tuple], eos: Sequence[int], mask_id: int
    ):
        self.matchers = list(matchers)
        self.candidates = list(candidates)  # each row's budget-guard search order
        self.guards = [m and BudgetGuard(m, c) for m, c in zip(self.matchers, self.candidates)]
        self.eos = sorted(eos)
        self.mask_id = mask_id
        self.rows = {}  # batch row -> _Row, for the constrained rows of the open block

    def select(self, keep: List[int]) -> None:
        """The rows `keep` only, between blocks or mid-block (the open block's states follow)."""
        self.matchers = [self.matchers[i] for i in keep]
        self.candidates = [self.candidates[i] for i in keep]
        self.guards = [self.guards[i] for i in keep]
        self.rows = {new: self.rows[old] for new, old in enumerate(keep) if old in self.rows}

    def _fits(self, row: int, left: int) -> bool:
        """Whether the row's grammar can still be closed, and EOS follow, in `left` positions."""
        return self.guards[row].fits(left)

    def row_mask(self) -> mx.array:
        """(B, 1) bool: the constrained rows."""
        return mx.array([m is not None for m in self.matchers])[:, None]

    def _consume(self, matcher, token: int) -> bool:
        return consume(matcher, token, self.eos)

    def open_block(self, x: mx.array, lo: int, stop: int, layout) -> mx.array:
        """The block's window [lo, stop) of `x` with each constrained row's tokens made valid: the
        leading tokens a backend put there kept while the grammar allows them (the rest back to
        masks), then the forced tokens filled (one host read)."""
        rows = [i for i, m in enumerate(self.matchers) if m is not None]
        self.rows = {}
        if not rows:
            return x
        idx = mx.array(rows)
        read = mx.concatenate(
            [
                x[idx, lo:stop],
                layout.decoded[idx, lo:stop].astype(x.dtype),
                layout.generated[idx, lo:stop].astype(x.dtype),
            ],
            axis=1,
        ).tolist()
        width = stop - lo
        new = np.array(x[:, lo:stop])
        for row, r in zip(rows, read):
            window, decoded, returned = r[:width], r[width : 2 * width], r[2 * width :]
            after = max(0, layout.ends[row] - stop)
            state = _Row(window, [], [], after)
            room = sum(returned) + after
            keeping = True
            for c in range(width):
                if not decoded[c]:
                    continue
                if not returned[c]:
                    state.tail.append(c)
                    window[c] = self.mask_id
                elif keeping and window[c] != self.mask_id:
                    m = self.matchers[row]
                    keeping = self._consume(m, window[c])
                    room -= 1
                    if keeping and not self._fits(row, room):
                        m.rollback(1)
                        keeping = False
                    if not keeping:
                        window[c] = self.mask_id
                        state.open.append(c)
                else:
                    keeping = False
                    window[c] = self.mask_id
                    state.open.append(c)
            self.rows[row] = state
            self._advance(row)
            new[row] = state.window
        return mx.concatenate([x[:, :lo], mx.array(new, dtype=x.dtype), x[:, stop:]], axis=1)

    def _advance(self, row: int) -> List[int]:
        """Fill the row's forced tokens (no forward needed), then EOS everywhere once the grammar
        can take nothing else or the row's returned columns are all committed; the columns filled."""
        state, matcher, done = self.rows[row], self.matchers[row], []
        while state.open and not matcher.is_stopped():
            forced = matcher.compute_ff_tokens()
            taken = 0
            for token in forced[: len(state.open)]:
                if not self._consume(matcher, token):
                    break
                c = state.open.pop(0)
                state.window[c] = token
                done.append(c)
                taken += 1
            if taken == 0:
                break
        if matcher.is_stopped() or not state.open:
            # Past EOS nothing is returned, and past max_tokens nothing either: EOS fills them
            # (the block must close without a mask). A stopped grammar takes EOS next.
            rest = (state.open if matcher.is_stopped() else []) + state.tail
            for c in rest:
                state.window[c] = self.eos[0]
            done.extend(rest)
            state.tail = []
            if matcher.is_stopped():
                state.open = []
        return done

    def commit(self, logits, idx, commit, x0, settings, spec, key):
        """The step's (commit, x0) with each constrained row's replaced by the prefix rule's.
        `logits`: the step's, over the batch rows `idx` (None: every row)."""
        live = [] if idx is None else idx.tolist()
        order = {r: i for i, r in enumerate(live)}
        rows = [r for r, s in self.rows.items() if s.open and (idx is None or r in order)]
        if not rows:
            return commit, x0
        mx.async_eval(logits, commit, x0)  # the device works while the host computes masks
        vocab = logits.shape[-1]
        words = np.stack(
            [np.frombuffer(self.matchers[r].compute_bitmask(), dtype=np.uint32) for r in rows]
        )
        lrows = mx.array([r if idx is None else order[r] for r in rows])
        first_cols = mx.array([self.rows[r].open[0] for r in rows])
        masked = mask_logits(logits[lrows, first_cols], allowed_tokens(mx.array(words), vocab))
        first = token_stats(
            masked[:, None, :],
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            key=None if settings.temperature == 0 else key[mx.array(rows)],
            suppress_ids=(spec.mask_token_id, *spec.suppressed_token_ids),
            order=spec.sampling_order,
        ).x0[:, 0]
        brows = mx.array(rows)
        read = mx.concatenate(
            [
                first[:, None].astype(mx.int32),
                x0[brows].astype(mx.int32),
                commit[brows].astype(mx.int32),
            ],
            axis=1,
        ).tolist()
        width = commit.shape[1]
        new_commit = np.zeros(commit.shape, dtype=bool)
        new_x0 = np.zeros(commit.shape, dtype=np.int32)
        which = np.zeros((commit.shape[0], 1), dtype=bool)
        for r, w, line in zip(rows, words, read):
            state, cols = self.rows[r], self.rows[r].open
            proposals, passes = line[1 : 1 + width], line[1 + width :]
            tokens = self._tokens(
                r, line[0], w, [proposals[c] for c in cols], [bool(passes[c]) for c in cols]
            )
            done = cols[: len(tokens)]
            for c, t in zip(done, tokens):
                state.window[c] = t
            state.open = cols[len(tokens) :]
            done = done + self._advance(r)
            which[r] = True
            new_commit[r, done] = True
            new_x0[r] = state.window
        which = mx.array(which)
        return (
            mx.where(which, mx.array(new_commit), commit),
            mx.where(which, mx.array(new_x0), x0.astype(mx.int32)),
        )

    def _tokens(self, row: int, first: int, words, proposals, passes) -> List[int]:
        """What the row commits at its open columns this step (consumed by its matcher): the
        prefix rule's tokens, each kept only while the grammar can still close within the row's
        budget after it; where the first cannot be, the closing tokens and EOS."""
        state, matcher = self.rows[row], self.matchers[row]
        room = state.room
        guarded = self._fits(row, room)  # else no closing fits at all: nothing to guard
        token = self._first(matcher, first, words)
        if guarded and not self._fits(row, room - 1):
            matcher.rollback(1)
            close = completion(matcher, room - 1, self.candidates[row])
            if close is None:  # no closing found after all: the model's token, unguarded
                matcher.try_consume_tokens([token])
                return [token]
            # The block's share of the closing: the rest follows in the next block's steps.
            tokens = close[: len(state.open)]
            matcher.try_consume_tokens(tokens)
            if len(tokens) < len(state.open) and self._consume(matcher, self.eos[0]):
                tokens.append(self.eos[0])
            return tokens
        used = [1]

        def consume(t):
            if not self._consume(matcher, t):
                return False
            used[0] += 1
            if guarded and not self._fits(row, room - used[0]):
                matcher.rollback(1)
                return False
            return True

        return commit_prefix(token, proposals[1:], passes[1:], consume, lambda t: t in self.eos)

    def _first(self, matcher, token: int, words) -> int:
        return take_first(matcher, token, words, self.eos)


def take_first(matcher, token: int, words, eos: Sequence[int]) -> int:
    """The first open column's token, consumed: the masked draw, or (when every allowed token's
    logit was -inf, e.g. EOS suppressed by logits_eos_inf) the lowest allowed id."""
    if consume(matcher, token, eos):
        return token
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    for t in np.flatnonzero(bits).tolist():
        if consume(matcher, t, eos):
            return t
    raise RuntimeError(f"the grammar allows no token here: {matcher.get_error()}")


def make_row_constraints(
    constraints: Optional[Sequence], consumed: Optional[Sequence], eos, mask_id
) -> Optional[RowConstraints]:
    """RowConstraints of a run's rows: `constraints` holds one structured.Constraint per row
    (None: unconstrained), `consumed` the tokens each row already returned (a restarted row),
    or None; None when no row is constrained."""
    if constraints is None or all(c is None for c in constraints):
        return None
    consumed = consumed or [()] * len(constraints)
    matchers = [None if c is None else c.matcher(t) for c, t in zip(constraints, consumed)]
    candidates = [() if c is None else c.candidates for c in constraints]
    return RowConstraints(matchers, candidates, eos, mask_id)


def consume(matcher, token: int, eos: Sequence[int]) -> bool:
    """Advance `matcher` by `token` if the grammar allows it there. EOS after a grammar that has
    stopped (it takes nothing else) is allowed and leaves it as it is (llguidance's
    try_consume_tokens refuses it there)."""
    if token in eos and matcher.is_stopped():
        return True
    return matcher.try_consume_tokens([int(token)]) == 1


class _OneRow:
    """What each single-row constraint keeps (self-speculation's, the canvas's, WeDLM's window's):
    the row's llguidance matcher (after the tokens `consumed` before a restart), its budget guard,
    the EOS ids, and the positions left for its text and EOS."""

    def __init__(self, constraint, eos: Sequence[int], max_tokens: int, consumed=()):
        self.matcher = constraint.matcher(consumed)
        self.candidates = constraint.candidates
        self.guard = BudgetGuard(self.matcher, self.candidates)
        self.eos = sorted(eos)
        self.room = max_tokens  # positions left for text and EOS


class TokenSequenceConstraint(_OneRow):
    """One row's constraint in self-speculation (engine/self_spec.py), whose rounds keep a prefix
    of drafts that a causal forward verifies, then the causal model's own next token. Under a
    grammar each verified position's distribution is masked by what the grammar allows after the
    kept tokens before it, so a draft is kept only where the constrained causal model agrees, and
    the output is constrained autoregressive decoding's (greedy: exactly; sampled: in
    distribution). Forced tokens replace the next round's first drafts (they are always kept),
    and the budget guard of the masked decoder applies to the round's tokens."""

    def masks(self, drafts: List[int], vocab: int):
        """(allowed (j + 1, vocab) bool, j): the grammar's allowed tokens at each verified
        position while the drafts before it are allowed; j drafts are (later ones cannot be
        kept). The matcher is left as it was."""
        words, j = [], 0
        for j in range(len(drafts) + 1):
            words.append(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32))
            if j == len(drafts) or self.matcher.try_consume_tokens([drafts[j]]) != 1:
                break
        if j:
            self.matcher.rollback(j)
        return allowed_tokens(mx.array(np.stack(words)), vocab), j

    def fits(self, left: int) -> bool:
        return self.guard.fits(left)

    def keep(self, new: List[int]) -> List[int]:
        """The round's tokens consumed, each kept while the grammar can still close within the
        row's budget after it; where one cannot, the closing tokens and EOS instead."""
        guarded = self.fits(self.room)
        out = []
        for t in new:
            if not consume(self.matcher, t, self.eos):
                raise RuntimeError(f"the grammar refused a token it allowed: {t}")
            if guarded and not self.fits(self.room - len(out) - 1):
                self.matcher.rollback(1)
                close = completion(self.matcher, self.room - len(out) - 1, self.candidates)
                self.matcher.try_consume_tokens(close)
                out += close
                if len(out) < self.room and consume(self.matcher, self.eos[0], self.eos):
                    out.append(self.eos[0])
                break
            out.append(t)
            if t in self.eos:
                break
        self.room -= len(out)
        if not out or out[-1] not in self.eos:
            if self.matcher.is_stopped() and self.room > 0:
                out.append(self.eos[0])  # the grammar takes nothing else
                self.room -= 1
        return out

    def forced(self) -> List[int]:
        """The tokens the grammar forces next (drafts that are always kept), within the room."""
        if self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[: max(self.room - 1, 0)]


class CanvasConstraint(_OneRow):
    """One row's constraint in canvas decoding (engine/canvas.py). A canvas re-draws every
    position at each step, so no prefix is final before its last step; the constraint acts on
    the readout: the canvas returned (and encoded for the next one) is, position by position, the
    best token the grammar allows after the ones before it under the last step's logits (the
    unconstrained readout takes the argmax everywhere), with forced tokens, EOS and the budget
    guard as in the masked decoder."""

    def _fits(self, left: int) -> bool:
        return self.guard.fits(left)

    def _take(self, token: int, guarded: bool, left: int) -> bool:
        """Consume `token` if the grammar allows it and (guarded) can still close after it in
        `left` - 1 positions."""
        if not consume(self.matcher, token, self.eos):
            return False
        if guarded and token not in self.eos and not self._fits(left - 1):
            self.matcher.rollback(1)
            return False
        return True

    def readout(self, ranked: List[List[int]], best_allowed, wanted: int) -> List[int]:
        """The canvas's first `wanted` tokens: `ranked[i]` are position i's most likely tokens,
        best first; `best_allowed(i, words)` the best token at position i among those the
        packed mask `words` allows (a device read, when none of the ranked ones will do)."""
        out: List[int] = []
        while len(out) < wanted:
            i, left = len(out), self.room - len(out)
            if self.matcher.is_stopped():
                out += [self.eos[0]] * (wanted - i)
                break
            forced = self.matcher.compute_ff_tokens()[: wanted - i]
            taken = self.matcher.try_consume_tokens(forced) if forced else 0
            if taken:
                out += forced[:taken]
                continue
            guarded = self._fits(left)
            token = next((t for t in ranked[i] if self._take(t, guarded, left)), None)
            if token is None:
                words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
                token = best_allowed(i, words)
                if not self._take(token, guarded, left):
                    close = (completion(self.matcher, left - 1, self.candidates) or [])[
                        : wanted - i
                    ]
                    self.matcher.try_consume_tokens(close)  # the rest in the next canvas
                    out += close
                    break
            out.append(token)
            if token in self.eos:
                break
        # After EOS nothing is returned (and where no closing was found, EOS ends the text).
        out += [self.eos[0]] * (wanted - len(out))
        self.room -= wanted
        return out


class WindowConstraint(_OneRow):
    """One row's constraint in WeDLM's window decoding (engine/wedlm.py), whose window commits
    its filled prefix at each step. A constrained row fills only a prefix of its window, so every
    step starts from a window of masks after its committed tokens: the first column takes the
    best token the grammar allows (the caller's masked draw), each following column its proposal
    while WeDLM's rule fills it and the grammar allows it after the tokens before it
    (commit_prefix), then the forced tokens and EOS fill the window's rest without a forward;
    the budget guard as in the masked decoder."""

    def __init__(self, constraint, eos: Sequence[int], max_tokens: int, consumed=()):
        super().__init__(constraint, eos, max_tokens, consumed)
        self.words = None  # the packed allowed set at the window's first column, this step

    def mask(self) -> np.ndarray:
        """The packed allowed set (llguidance's 32-bit words) at the next position, kept for
        `step`; none once the grammar has stopped (EOS comes next, no draw needed)."""
        if self.matcher.is_stopped():
            self.words = None
        else:
            self.words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        return self.words

    def step(self, first: int, proposals: List[int], passes: List[bool]) -> List[int]:
        """The tokens the row fills at its window's first columns this step, consumed:
        `first` the masked draw at column 0, `proposals` / `passes` the model's proposals at the
        columns after it and whether WeDLM's rule fills each; at most 1 + len(proposals)."""
        width = 1 + len(proposals)
        if self.matcher.is_stopped():
            out = [self.eos[0]]
        else:
            out = self._prefix(first, proposals, passes, width)
        out += self._forced(out, min(width, self.room) - len(out))
        self.room -= len(out)
        return out

    def _prefix(self, first, proposals, passes, width) -> List[int]:
        guarded = self.guard.fits(self.room)  # else no closing fits at all: nothing to guard
        token = take_first(self.matcher, first, self.words, self.eos)
        if guarded and token not in self.eos and not self.guard.fits(self.room - 1):
            self.matcher.rollback(1)
            close = completion(self.matcher, self.room - 1, self.candidates)
            if close is None:  # no closing found after all: the model's token, unguarded
                self.matcher.try_consume_tokens([token])
                return [token]
            close = close[:width]
            self.matcher.try_consume_tokens(close)  # the rest in the next steps
            if len(close) < width and consume(self.matcher, self.eos[0], self.eos):
                close.append(self.eos[0])
            return close
        used = [1]

        def take(t):
            if not consume(self.matcher, t, self.eos):
                return False
            if guarded and t not in self.eos and not self.guard.fits(self.room - used[0] - 1):
                self.matcher.rollback(1)
                return False
            used[0] += 1
            return True

        return commit_prefix(token, proposals, passes, take, lambda t: t in self.eos)

    def _forced(self, out: List[int], n: int) -> List[int]:
        """Up to `n` tokens after `out` that need no forward: the grammar's forced ones, then EOS
        once it takes nothing else."""
        added: List[int] = []
        while len(added) < n and not (out + added and (out + added)[-1] in self.eos):
            if self.matcher.is_stopped():
                added.append(self.eos[0])
                break
            forced = self.matcher.compute_ff_tokens()[: n - len(added)]
            taken = self.matcher.try_consume_tokens(forced) if forced else 0
            if not taken:
                break
            added += forced[:taken]
        return added
