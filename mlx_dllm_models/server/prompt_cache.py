"""The server's prompt cache: the K/V that finished requests leave, reused by later requests whose
prompt continues the same tokens (a client resending a growing conversation).

An entry is a cache.PriorKV: the final K/V of a one-row run's columns (its prompt and what it
generated) and the kind of attention that computed them. A request that starts a run on its own
takes the entry sharing the longest prefix with its prompt; the backend reuses the K/V over that
prefix (whole blocks for block-causal families, any prefix for a causal one) and computes the rest,
so its tokens equal a run without the cache. Bidirectional (full recompute) and canvas families keep
no K/V to reuse. Rows that share a batch with others recompute their prompt: a batch lays its rows
out with per-row left padding, which an entry's columns do not have.

Bounded as mlx_lm.server's is: at most `max_entries` entries (--prompt-cache-size) and, when set,
`max_bytes` of K/V (--prompt-cache-bytes); the least recently used entry goes first.
"""

from typing import List, Optional, Sequence

from ..cache import PriorKV
from .limits import parse_size  # noqa: F401  (the flag's parser, imported from here too)


def kv_bytes(prior: PriorKV) -> int:
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for layer in prior.cache.layers
        if layer.keys is not None
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """Recently used PriorKVs, the most recent last."""

    def __init__(self, max_entries: int = 10, max_bytes: Optional[int] = None):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: List[PriorKV] = []
        self.hits = 0  # lookups that found a shared prefix (the benchmark reads it)

    def find(self, ids: Sequence[int], kind: str) -> Optional[PriorKV]:
        """The entry of this kind sharing the longest prefix with `ids` (None when none shares
        any); it becomes the most recently used."""
        best, shared = None, 0
        for prior in self.entries:
            if prior.kind == kind:
                n = common_prefix(prior.tokens, ids)
                if n > shared:
                    best, shared = prior, n
        if best is not None:
            self.entries.remove(best)
            self.entries.append(best)
            self.hits += 1
        return best

    def add(self, prior: PriorKV):
        """Keep `prior`; an entry whose tokens it extends goes (it holds nothing more)."""
        self.entries = [
            e
            for e in self.entries
            if not (e.kind == prior.kind and common_prefix(e.tokens, prior.tokens) == len(e.tokens))
        ]
        self.entries.append(prior)
        while len(self.entries) > self.max_entries:
            self.entries.pop(0)
        if self.max_bytes is not None:
            while self.entries and sum(kv_bytes(e) for e in self.entries) > self.max_bytes:
                self.entries.pop(0)

    @property
    def nbytes(self) -> int:
        return sum(kv_bytes(e) for e in self.entries)
