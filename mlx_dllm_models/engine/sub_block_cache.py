"""Fast-dLLM v2's sub-block cache (`cache="sub_block"`; the remote generate's
`use_block_cache=True`): approximate, opt-in.

The exact prefix cache (block_cache.PrefixCache) runs every denoising step over the whole block.
Here a row's step runs the whole block only when the block begins or when its current sub-block's
first position is still a mask; the K/V of that forward are kept, and the row's later steps run
its current sub-block alone, writing the sub-block's K/V over the kept ones and attending, with
no mask, to the prefix and the whole block, whose other positions keep the K/V of the last full
forward (stale once their tokens change). The sub-block's first column is read at itself (the
reference's shift within the sub-block forward); it holds a decided token there, since a mask in
that column calls for a full forward. Only the `sub_block` sampler, one sub-block a step, uses
these logits: other columns of a sub-block forward are not computed (zeros).

Rows of a batch are in different states; each step runs at most two forwards (the rows that need
a full one, then the others at their own sub-blocks, each row's RoPE positions its own), and K/V
are kept only for the rows a forward was for, so a row's tokens are those of its single run.
"""

import mlx.core as mx

from ..cache import zero_kv
from ..masks import block_causal_mask
from ..settings import SettingsError
from .block_cache import PrefixCache


class _RowWrites:
    """The caches of one forward over the main PrefixKVCache of the run: the forward's K/V go to
    columns [start, start + L) (full) or to each row's own sub-block (`offsets`, the sub-block's
    first column in the block at `start`), and are kept for the rows of `keep` only; queries read
    every key from column 0 to the block's end."""

    def __init__(self, main, start, keep, offsets=None, block=None):
        self.main, self.start, self.keep = main, start, keep[:, None, None, None]
        self.offsets, self.block = offsets, block
        first = start if offsets is None else start + offsets
        self.offset = first if main.pads is None else first - main.pads
        self.layers = [_RowWritesLayer(self, layer) for layer in main.layers]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)


class _RowWritesLayer:
    def __init__(self, owner, layer):
        self.owner, self.layer = owner, layer

    @property
    def offset(self):
        return self.owner.offset

    def update_and_fetch(self, keys, values):
        o, layer = self.owner, self.layer
        if layer.keys is None:  # a run whose prompt holds no whole block: nothing prefilled
            layer.keys, layer.values = zero_kv(keys, values, o.main.width)
        start = o.start
        stop = start + (keys.shape[2] if o.offsets is None else o.block)
        old_k, old_v = layer.keys[..., start:stop, :], layer.values[..., start:stop, :]
        if o.offsets is None:
            new_k, new_v = keys, values
        else:  # each row's sub-block K/V over the kept block K/V
            cols = mx.arange(o.block)[None, :] - o.offsets[:, None]
            inside = ((cols >= 0) & (cols < keys.shape[2]))[:, None, :, None]
            at = mx.clip(cols, 0, keys.shape[2] - 1)[:, None, :, None]
            new_k = mx.where(inside, mx.take_along_axis(keys, at, axis=2), old_k)
            new_v = mx.where(inside, mx.take_along_axis(values, at, axis=2), old_v)
        layer.keys[..., start:stop, :] = mx.where(o.keep, new_k, old_k)
        layer.values[..., start:stop, :] = mx.where(o.keep, new_v, old_v)
        prefix_k, prefix_v = layer.keys[..., :start, :], layer.values[..., :start, :]
        return (
            mx.concatenate([prefix_k, new_k], axis=2),
            mx.concatenate([prefix_v, new_v], axis=2),
        )


class SubBlockCache(PrefixCache):
    """Backend of the masked block engine (see full_recompute.py for the interface)."""

    # A step's forwards keep K/V per row in the run's cache: never on a selected view.
    row_steps = False

    @classmethod
    def check_settings(cls, spec, settings):
        if settings.sampler != "sub_block" or not spec.seeds_block_start:
            raise SettingsError(
                "cache='sub_block' is Fast-dLLM v2's sub-block cache: it needs the sub_block "
                "sampler of that family; pass sampler='sub_block' or another cache"
            )
        if settings.steps < settings.block_length:
            raise SettingsError(
                f"cache='sub_block' decodes one sub-block a step, so steps ({settings.steps}) "
                f"must be at least block_length ({settings.block_length}); raise steps or "
                "pass another cache"
            )

    def __init__(self, model, spec, layout, settings):
        super().__init__(model, spec, layout, settings)
        self.sub = settings.sub_block_length
        self.filled = None  # (B,) rows whose block K/V a full forward of this block left

    def begin_block(self, x, start, stop):
        x = super().begin_block(x, start, stop)
        self.filled = mx.zeros((x.shape[0],), dtype=mx.bool_)
        return x

    def block_logits(self, x, start, stop):
        block_start = (start // self.block) * self.block
        block_stop = block_start + self.block
        mask_id = self.spec.mask_token_id
        masks = (x[:, block_start:block_stop] == mask_id) & self.decoded[:, block_start:block_stop]
        index = mx.arange(self.block) // self.sub
        last = self.block // self.sub
        current = mx.where(masks, index[None, :], last).min(axis=1)  # (B,) first open sub-block
        active = current < last
        offsets = mx.minimum(current, last - 1) * self.sub
        head = mx.take_along_axis(masks, offsets[:, None], axis=1)[:, 0]
        full = active & (~self.filled | head)
        part = active & ~full
        need_full, need_part = (v.item() for v in (full.any(), part.any()))
        out = None
        if need_full or not need_part:  # (rows without masks left run nothing of their own)
            out = self._full(x, start, stop, full)
            self.filled = self.filled | full
        if need_part:
            logits = self._part(x, block_start, offsets, part)
            # Each row's sub-block columns of the window [start, stop); the rest stay 0.
            cols = mx.arange(stop - start)[None, :] - (offsets + block_start - start)[:, None]
            inside = ((cols >= 0) & (cols < self.sub))[:, :, None]
            at = mx.clip(cols, 0, self.sub - 1)[:, :, None]
            placed = mx.where(inside, mx.take_along_axis(logits, at, axis=1), 0.0)
            out = placed if out is None else mx.where(part[:, None, None], placed, out)
        return out

    def _full(self, x, start, stop, rows):
        """The whole block's forward (the window's logits, shifted), its K/V kept for `rows`."""
        self.nfe += 1
        first = self.cache.committed
        block_stop = first + self.block
        caches = _RowWrites(self.cache, first, rows)
        mask = None
        if self.pads is not None:
            mask = block_causal_mask(self.block, self.block, offset=first, left_padding=self.pads)
        lo = start - first - self.shift
        logits = self.model(
            x[:, first:block_stop],
            cache=caches,
            mask=mask,
            head_span=(max(lo, 0), stop - first - 1),
        )
        if lo < 0:  # the seeded first column, read at itself (block_cache.PrefixCache)
            logits = mx.concatenate([logits[:, :1], logits], axis=1)
        return logits

    def _part(self, x, block_start, offsets, rows):
        """Each row's current sub-block alone (sub_block_length columns at `offsets` in the
        block), against the kept K/V; (B, sub_block_length, V) logits, each column read at the
        one before it within the sub-block and the first at itself."""
        self.nfe += 1
        at = (block_start + offsets)[:, None] + mx.arange(self.sub)[None, :]
        tokens = mx.take_along_axis(x, at, axis=1)
        caches = _RowWrites(self.cache, block_start, rows, offsets=offsets, block=self.block)
        mask = None
        if self.pads is not None:  # every real key of the prefix and the block
            keys = mx.arange(block_start + self.block)[None, :]
            mask = (keys >= mx.array(self.pads)[:, None])[:, None, None, :]
        logits = self.model(tokens, cache=caches, mask=mask)
        return mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1)

    def select(self, layout, idx):
        fresh = super().select(layout, idx)
        fresh.filled = None if self.filled is None else self.filled[mx.array(idx)]
        return fresh
