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
