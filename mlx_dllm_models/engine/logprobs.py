"""The `logprobs` setting in the loops: each committed position's log-probability and best
alternatives (decoding.logprobs), recorded on the device as steps decide positions and read with
the tokens they belong to, in the read the loop makes anyway.

Off (the setting None), no loop builds any of this: not an array, not a read.
"""

import math
from typing import List, Optional, Sequence

import mlx.core as mx

from ..decoding.logprobs import log_probs, token_log_probs
from .base import TokenLogprob


class PositionLogprobs:
    """(B, W) positions of a window (a block's candidates, a canvas): the log-probability of the
    token each holds under the logits of the step that last decided it, and the k best
    alternatives there. Device arrays, updated by each step without a host read (evaluated
    asynchronously, so that no step's logits stay alive), read by `packed` with the tokens."""

    def __init__(self, k: int, never: Sequence[int], rows: int, width: int):
        self.k, self.never = k, tuple(never)
        self.value = mx.full((rows, width), math.nan, dtype=mx.float32)
        self.ids = mx.zeros((rows, width, k), dtype=mx.int32)
        self.top = mx.full((rows, width, k), math.nan, dtype=mx.float32)
        self.known = mx.zeros((rows, width), dtype=mx.bool_)

    def put(self, logp, tokens, where, rows=None, never=None):
        """At the positions `where` (rows x window, broadcast), the log-probability of `tokens`
        under `logp` (rows x window x V, log-softmax; a window of 1 broadcasts) and its best
        alternatives. `rows`: the row indices that `logp` and `tokens` are of (None: every row)."""
        never = self.never if never is None else never
        value, ids, top = token_log_probs(logp, tokens, self.k, never)
        arrays = ("value", "ids", "top", "known")
        new = (value, ids, top, mx.array(True))
        for name, fresh in zip(arrays, new):
            old = getattr(self, name)
            if old.size == 0:  # k = 0 (a scatter into an empty array would divide by zero)
                continue
            here = where if old.ndim == 2 else where[..., None]
            if rows is None:
                setattr(self, name, mx.where(here, fresh, old))
            else:
                old[rows] = mx.where(here, fresh, old[rows])
        mx.async_eval(self.value, self.ids, self.top, self.known)

    def select(self, keep) -> None:
        """The rows `keep` only (the others left the batch mid-block)."""
        idx = mx.array(keep)
        self.value, self.ids, self.top = self.value[idx], self.ids[idx], self.top[idx]
        self.known = self.known[idx]

    def record(self, logits, tokens, decided, rows=None):
        """After a step whose `logits` gave the window's `tokens` (the window after the step):
        the positions it `decided` (committed, or edited), and those never recorded yet (a token
        no forward chose, such as a forced end-of-thinking marker: its log-probability at the
        first forward that saw it)."""
        known = self.known if rows is None else self.known[rows]
        self.put(log_probs(logits), tokens, decided | ~known, rows)

    def packed(self, stop: Optional[int] = None) -> mx.array:
        """(B, n * (1 + 2k)) float32 of the window's first `stop` columns, for a loop's one read
        (token ids are exact in float32 below 2**24)."""
        value, ids, top = self.value[:, :stop], self.ids[:, :stop], self.top[:, :stop]
        b, n = value.shape  # (no -1 in the reshapes: with k = 0 it would divide by zero)
        return mx.concatenate(
            [value, ids.astype(mx.float32).reshape(b, n * self.k), top.reshape(b, n * self.k)],
            axis=1,
        )

    def unpack(self, floats: Sequence[float], tokens: Sequence[int]) -> List[TokenLogprob]:
        """One row of `packed` -> a TokenLogprob per column (`tokens`: the row's tokens there)."""
        n, k = len(tokens), self.k
        ids, top = floats[n : n + n * k], floats[n + n * k :]
        return [
            TokenLogprob(
                int(t),
                floats[c],
                tuple((int(ids[c * k + j]), top[c * k + j]) for j in range(k)),
            )
            for c, t in enumerate(tokens)
        ]


def entries(logits, tokens: Sequence[int], k: int, never: Sequence[int] = ()) -> List[TokenLogprob]:
    """The TokenLogprob of each of `tokens`, given by the rows of `logits` (n, V) in turn: one
    read (self-speculation's confirmed tokens)."""
    n = len(tokens)
    rec = PositionLogprobs(k, never, 1, n)
    rec.put(log_probs(logits[:n])[None], mx.array([tokens], dtype=mx.int32), mx.array(True))
    return rec.unpack(rec.packed()[0].tolist(), tokens)
