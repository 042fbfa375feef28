"""The decoding engine: loops that own state, over backends that compute a block's logits.

contracts.py       the backend's and the decoder's contracts: Backend / Decoder (every capability a
                   typed attribute with its default), BlockBackend / WindowBackend, DecoderInputs
base.py            events (StepEvent, BlockEvent), the block-event helper, the finite-logits check,
                   next_key / sample_tokens (a token drawn from logits with an owner's own key)
layout.py          Layout: where each row's prompt and canvas sit in the batch's token array
masked.py          masked block decoding (MaskedBlockDecoder): the loop over blocks and steps
editing.py         LLaDA2.1's token editing over one block (BlockEditing), 2.2's insert/delete
                   edits (LevenshteinEditing)
logprobs.py        the logprobs setting: each committed position's log-probability, recorded on
                   the device and read with its tokens (PositionLogprobs)
full_recompute.py  FullRecompute, the reference backend (every forward over the whole sequence)
block_cache.py     exact prefix KV cache of block-causal families (SDAR, LLaDA2)
causal_prefix.py   AR-seeded blocks over a causal KV prefix (Nemotron)
fast_dllm.py       Fast-dLLM's approximate prefix / dual caches of bidirectional families
self_spec.py       lossless self-speculation (Nemotron mode="self_spec")
canvas.py          uniform-noise canvas decoding (DiffusionGemma)
registry.py        the backend and decoder tables, make_decoder / build_decoder, join_policy

The sampler -> commit rule lookup is decoding.samplers.commit_rule (StepContext re-exported here).
"""

from ..decoding.samplers import StepContext
from .base import BlockEvent, StepEvent, TokenLogprob
from .contracts import Backend, BlockBackend, Decoder, DecoderInputs
from .full_recompute import FullRecompute
from .layout import Layout
from .masked import MaskedBlockDecoder
from .registry import (
    BACKENDS,
    DECODERS,
    Batching,
    build_decoder,
    cache_choices,
    join_policy,
    make_decoder,
    select_backend,
    select_decoder,
)

__all__ = [
    "Backend",
    "BlockBackend",
    "Decoder",
    "DecoderInputs",
    "build_decoder",
    "BlockEvent",
    "StepEvent",
    "TokenLogprob",
    "FullRecompute",
    "Layout",
    "MaskedBlockDecoder",
    "StepContext",
    "BACKENDS",
    "DECODERS",
    "Batching",
    "cache_choices",
    "join_policy",
    "make_decoder",
    "select_backend",
    "select_decoder",
]
