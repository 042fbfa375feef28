"""Caches the engine hands to models through mlx-lm's attention protocol.

mlx-lm's attention layers read `cache.offset` (the RoPE position of the first query row, an int or a
(B,) array for per-row positions) and call `cache.update_and_fetch(keys, values)`.
"""

import mlx.core as mx


class Positions:
    """No cache at all, only per-row RoPE offsets.

    Full-recompute decoding of left-padded batches needs each row's positions to count its real
    tokens only (row b's first real token at position 0), which mlx-lm's layers express through
    `cache.offset`. Keys and values pass through untouched.
    """

    def __init__(self, offset):
        self.offset = offset

    def update_and_fetch(self, keys, values):
        return keys, values

    @classmethod
    def for_left_padding(cls, left_padding, num_layers):
        if not any(int(p) for p in left_padding):
            return None
        offset = -mx.array(left_padding, dtype=mx.int32)
        return [cls(offset) for _ in range(num_layers)]


def zero_kv(keys, values, width: int):
    """Zeroed K and V buffers of `width` columns, shaped (B, kv_heads, width, head_dim) as `keys`
    and `values` are."""
    b, h, _, d = keys.shape
    return (
        mx.zeros((b, h, width, d), keys.dtype),
        mx.zeros((b, values.shape[1], width, values.shape[3]), values.dtype),
    )


class LayerKV:
    """One layer's K/V buffers, allocated at the first write; the cursor (and so the RoPE
    `offset` mlx-lm's layers read) is the owner's, shared by every layer."""

    def __init__(self, owner):
        self.owner = owner
        self.keys = None
        self.values = None

    @property
    def offset(self):
        return self.owner.offset


class BlockKVCache(LayerKV):
    """K/V of one layer over the columns of a block-aligned layout (block-causal families).

    The buffer holds the whole window (B, kv_heads, width, head_dim), allocated at the first
    write. A forward over columns start..start+L-1 writes its K/V there in place and reads the keys
    of columns 0..start+L-1 as a slice: the committed prefix is never copied or concatenated. The
    cursor (`start`, `committed`) is shared by every layer through `PrefixKVCache`.
    """

    def update_and_fetch(self, keys, values):
        start, width = self.owner.start, self.owner.width
        end = start + keys.shape[2]
        if end > width:
            raise ValueError(f"write of columns {start}..{end - 1} past the cache width {width}")
        if self.keys is None:
            self.keys, self.values = zero_kv(keys, values, width)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]


class LayerCaches:
    """A model's per-layer K/V (`layers`), passed as mlx-lm's `cache=` list: iterated and indexed
    by layer."""

    layers: list

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def take_rows(self, other: "LayerCaches", rows: mx.array) -> None:
        """This cache's K/V become rows `rows` of `other`'s (layers not yet written stay empty)."""
        for new, old in zip(self.layers, other.layers):
            if old.keys is not None:
                new.keys, new.values = old.keys[rows], old.values[rows]


class PrefixKVCache(LayerCaches):
    """The per-layer `BlockKVCache`s of a model and their shared cursor; pass it as `cache=`.

    `committed`: columns 0..committed-1 hold final K/V (finished blocks). `at(start)` places the
    next forward's first input column; a forward at or past `committed` leaves the prefix intact,
    so the open block's K/V are rewritten in place at every denoising step without moving the
    committed offset, and `commit(column)` moves it once a forward has written final K/V up to there.
    `offset` is what mlx-lm's layers take as the RoPE position of the first input row: the column
    minus each row's left padding, a (B,) array when rows are padded.
    """

    layer_class = BlockKVCache

    def __init__(self, num_layers: int, width: int, left_padding=None):
        self.width = width
        self.start = 0
        self.committed = 0
        pads = [int(p) for p in (left_padding or [])]
        self.pads = mx.array(pads, dtype=mx.int32) if any(pads) else None
        self.layers = [self.layer_class(self) for _ in range(num_layers)]
        # Per-row arrays (B, ...) a model keeps with its K/V for later forwards of the same run
        # (Dimple's M-RoPE offsets of the columns), kept row for row by `select`.
        self.row_state = {}

    @property
    def offset(self):
        return self.start if self.pads is None else self.start - self.pads

    def at(self, start: int) -> "PrefixKVCache":
        if start > self.committed:
            raise ValueError(
                f"a forward from column {start} would leave columns {self.committed}..{start - 1} "
                "without final K/V"
            )
        self.start = start
        return self

    def commit(self, column: int):
        self.committed = max(self.committed, column)

    def select(self, idx, left_padding) -> "PrefixKVCache":
        """The cache of rows `idx` (rows that finished are dropped from the batch)."""
        out = type(self)(len(self.layers), self.width, left_padding)
        out.start, out.committed = self.start, self.committed
        rows = mx.array(idx)
        out.row_state = {name: value[rows] for name, value in self.row_state.items()}
        out.take_rows(self, rows)
        return out


class _RowLayerKV(LayerKV):
    """One layer's K/V of `RowKVCache`: (B, kv_heads, width + 1, head_dim), written in place; the
    last column takes the writes of padding inputs (never read)."""

    def update_and_fetch(self, keys, values):
        o = self.owner
        if self.keys is None:
            self.keys, self.values = zero_kv(keys, values, o.width + 1)
        cols = o.columns[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(cols, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(
            self.values, mx.broadcast_to(cols, values.shape), values, axis=2
        )
        return self.keys[..., : o.end, :], self.values[..., : o.end, :]


class RowKVCache(LayerCaches):
    """Per-layer K/V of a batch whose rows sit at columns of their own (self-speculation's rows
    keep a different number of tokens every round): `place(starts, stops)` says that a forward's
    input row b holds columns starts[b]..stops[b]-1 (the rest of it is padding); its K/V are
    written there, RoPE reads the same columns (`offset`, a (B,) array), and the forward reads
    the keys of columns 0..max(stops)-1, which the caller's mask restricts per row."""

    def __init__(self, num_layers: int, rows: int, width: int):
        self.width = width
        self.starts = [0] * rows
        self.columns = None  # (B, L) the column of each input, `width` for padding
        self.end = 0
        self.layers = [_RowLayerKV(self) for _ in range(num_layers)]

    @property
    def offset(self):
        return mx.array(self.starts, dtype=mx.int32)

    def place(self, starts, stops, length: int) -> "RowKVCache":
        if max(stops) > self.width:
            raise ValueError(f"a write up to column {max(stops) - 1} past the width {self.width}")
        first = mx.array(starts, dtype=mx.int32)[:, None]
        cols = first + mx.arange(length, dtype=mx.int32)[None]
        self.columns = mx.where(cols < mx.array(stops, dtype=mx.int32)[:, None], cols, self.width)
        self.starts, self.end = list(starts), max(stops)
        return self

    def select(self, idx) -> "RowKVCache":
        """The cache of rows `idx` (rows that finished leave the batch)."""
        out = RowKVCache(len(self.layers), len(idx), self.width)
        rows = mx.array(list(idx))
        out.take_rows(self, rows)
        return out


class WindowKVCache(BlockKVCache):
    """A `BlockKVCache` whose forwards read the K/V of every column of the window, not only of
    the columns up to their last one: a forward over some columns writes their K/V in place and
    attends to what earlier forwards left in all the others. That is Fast-dLLM's dual cache
    (`replace_position`), whose block attends to a stale suffix; its prefix cache runs to the
    window's end, where both read the same columns."""

    def update_and_fetch(self, keys, values):
        super().update_and_fetch(keys, values)
        return self.keys, self.values


class ApproximateKVCache(PrefixKVCache):
    """The per-layer `WindowKVCache`s of a model and their shared cursor (see PrefixKVCache):
    the cache of engine.fast_dllm's approximate backends."""

    layer_class = WindowKVCache


class PriorKV:
    """The final K/V a finished run leaves for a later run whose prompt continues the same tokens
    (a chat's next turn): `tokens` are the ids of columns 0..len(tokens)-1, whose K/V in `cache`
    (batch 1) are final. The later run reuses them over the prefix its prompt shares with
    `tokens` and computes the rest, so its tokens equal a run without them. `kind` names the
    attention that computed them (e.g. "block-causal/4": block-causal K/V depend on the block
    partition), which the later run must share."""

    def __init__(self, tokens, cache: PrefixKVCache, kind: str):
        self.tokens = [int(t) for t in tokens]
        self.cache = cache
        self.kind = kind

    def check(self, kind: str):
        if kind != self.kind:
            raise ValueError(
                f"these K/V were computed under {self.kind} attention, not {kind}; reuse them "
                "with the same model and block_length only"
            )

    def shared(self, ids, unit: int, limit: int) -> int:
        """Columns reusable for a prompt `ids`: the common prefix, at most `limit`, rounded down
        to a multiple of `unit` (block-causal K/V depend on their whole block)."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != int(b):
                break
            n += 1
        n = min(n, limit)
        return max(0, n // unit * unit)

    def cache_for(self, width: int, keep: int) -> PrefixKVCache:
        """A fresh PrefixKVCache of `width` columns holding the first `keep` columns' K/V."""
        out = PrefixKVCache(len(self.cache.layers), width)
        out.committed = keep
        if keep == 0:
            return out
        for new, old in zip(out.layers, self.cache.layers):
            new.keys, new.values = zero_kv(old.keys, old.values, width)
            new.keys[..., :keep, :] = old.keys[..., :keep, :]
            new.values[..., :keep, :] = old.values[..., :keep, :]
        return out
