"""The decoding engine: loops that own state, over backends that compute a block's logits.

base.py           events (StepEvent, BlockEvent) and the block-event helper every loop uses
masked.py         masked block decoding (Layout, FullRecompute, MaskedBlockDecoder)
block_cache.py    exact prefix KV cache of block-causal families (SDAR, LLaDA2)
causal_prefix.py  AR-seeded blocks over a causal KV prefix (Nemotron)
self_spec.py      lossless self-speculation (Nemotron mode="self_spec")
canvas.py         uniform-noise canvas decoding (DiffusionGemma)
registry.py       the backend and decoder tables, make_decoder
"""

from .base import BlockEvent, StepEvent
from .masked import FullRecompute, Layout, MaskedBlockDecoder, StepContext
from .registry import (
    BACKENDS,
    DECODERS,
    cache_choices,
    make_decoder,
    select_backend,
    select_decoder,
)

__all__ = [
    "BlockEvent",
    "StepEvent",
    "FullRecompute",
    "Layout",
    "MaskedBlockDecoder",
    "StepContext",
    "BACKENDS",
    "DECODERS",
    "cache_choices",
    "make_decoder",
    "select_backend",
    "select_decoder",
]
