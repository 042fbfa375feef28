"""The engine's two tables, as plain literals: which backend computes a block's logits for an
attention layout and a `cache` setting, and which decoding loop a family (or its `mode`) runs.

"auto" is a layout's first cache: the exact cache where the layout allows one, else full recompute.
A layout's cache choices are exactly its rows here, so validation, the error message and the
decoders read one truth.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Type

from ..settings import SettingsError
from ..spec import (
    BIDIRECTIONAL,
    BLOCK_CAUSAL,
    CAUSAL_PREFIX,
    CAUSAL_WINDOW,
    CLEAN_PREFIX,
    ENCODER_CANVAS,
    PREFIX_DLM,
    DiffusionSpec,
    for_settings,
)
from .block_cache import PrefixCache
from .canvas import CanvasDecoder
from .causal_prefix import CausalPrefixCache, CausalPrefixRecompute
from .contracts import Backend, Decoder, DecoderInputs
from .fast_dllm import ApproxPrefixCache, DualCache
from .full_recompute import FullRecompute
from .masked import MaskedBlockDecoder
from .prefill import PrefillCache
from .prefix_dlm import PrefixDLMCache
from .self_spec import SelfSpeculativeDecoder
from .sub_block_cache import SubBlockCache
from .wedlm import WindowKV, WindowRecompute

# attention layout -> {cache setting: backend class}, the layout's default ("auto") first.
BACKENDS: Dict[str, Dict[str, Type[Backend]]] = {
    # Fast-dLLM's prefix and dual caches and Dimple's prefill are approximations: opt-in, never
    # "auto" (Dimple's recipe names prefill).
    BIDIRECTIONAL: {
        "none": FullRecompute,
        "prefix": ApproxPrefixCache,
        "dual": DualCache,
        "prefill": PrefillCache,
    },
    # Fast-dLLM v2's sub-block cache is an approximation: opt-in, and refused by other families.
    BLOCK_CAUSAL: {"prefix": PrefixCache, "none": FullRecompute, "sub_block": SubBlockCache},
    CAUSAL_PREFIX: {"prefix": CausalPrefixCache, "none": CausalPrefixRecompute},
    # The canvas decoder keeps its encoder's KV cache itself: nothing to choose.
    ENCODER_CANVAS: {},
    # GIDD's decoder keeps the clean prefix's K/V itself, recomputed once a block (exact).
    CLEAN_PREFIX: {},
    # WeDLM's window over a causal K/V cache, or every forward over the whole row.
    CAUSAL_WINDOW: {"prefix": WindowKV, "none": WindowRecompute},
    # LaViDa's two modes: prefix_lm=True, the prompt's K/V kept (exact: the prompt never attends
    # to the answer; the README's "KV cache on"), or prefix_lm=False, every forward over the whole
    # sequence attending everywhere ("KV cache off", as LLaDA's and Dream's own generate).
    PREFIX_DLM: {"prefix": PrefixDLMCache, "none": FullRecompute},
}

# Decoding loops by name: a family's spec names its default (`DiffusionSpec.decoder`); its `mode`
# setting, where it has one, can pick another (Nemotron's self-speculation). A family's own loop is
# registered by its spec (`DiffusionSpec.decoders`: WeDLM's engine.wedlm.WeDLMDecoder).
DECODERS: Dict[str, Type[Decoder]] = {
    "masked": MaskedBlockDecoder,
    "diffusion": MaskedBlockDecoder,
    "self_spec": SelfSpeculativeDecoder,
    "canvas": CanvasDecoder,
}


def cache_choices(attention: str) -> Tuple[str, ...]:
    return ("auto",) + tuple(sorted(BACKENDS[attention]))


def select_backend(spec: DiffusionSpec, settings) -> Optional[Type[Backend]]:
    """The backend class for the spec's layout and the `cache` setting (None for a layout whose
    decoder keeps its own cache). `spec`: the family's, or the effective one (a Request's)."""
    spec = for_settings(spec, settings)  # a sampler may bring its layout (dllm's bd3lm)
    table = BACKENDS[spec.attention]
    cache = settings.cache or "auto"
    if cache == "auto":
        return next(iter(table.values()), None)
    if cache not in table:
        raise SettingsError(
            f"cache={cache!r} is not available for the {spec.family} family "
            f"({spec.attention} attention); choose one of: {', '.join(cache_choices(spec.attention))}"
        )
    backend = table[cache]
    backend.check_settings(spec, settings)  # what it cannot honour fails before decoding starts
    return backend


@dataclass(frozen=True)
class Batching:
    """How a run of some settings takes rows, as the server's scheduler needs to know."""

    joins: bool  # rows may join a running batch at a block boundary, exactly (a restart)
    free_join: bool  # such a join re-encodes nothing (the backend keeps no K/V)
    drops_rows: bool  # the decoder drops a cancelled row before its next step (run(cancelled=))
    # The kind of K/V (cache.PriorKV.kind) a one-row run leaves for a later prompt that continues
    # its tokens, and can resume from (`run(prompts, prior=...)`); None: nothing reusable.
    kv_kind: Optional[str] = None
    # Each row draws from a stream of its own seed (make_decoder's row_seeds): rows whose seeds
    # differ may share a run.
    row_seeds: bool = False


def join_policy(spec: DiffusionSpec, settings) -> Batching:
    """What the decoder and backend of these (resolved) settings declare (engine.contracts): a
    decoder whose run drops cancelled rows before its next step says `drops_cancelled_rows` (every
    decoder today); rows join where a restart over [prompt ; committed] with per-row budgets
    reproduces the run: the backend says `joins_exactly(settings)`, or the decoder when it
    `judges_joins` (the canvas and WeDLM decoders, which take no budgets, have no backend that
    does). `spec`: the family's, or the effective one (a Request's)."""
    spec = for_settings(spec, settings)
    decoder = select_decoder(spec, settings)
    drops = decoder.drops_cancelled_rows
    backend = select_backend(spec, settings) if drops else None
    # A decoder that judges its own restarts says so (self-speculation's rows are AR decoding,
    # whatever the backend's blocks); else its backend does.
    judge = decoder if decoder.judges_joins else backend
    joins = judge is not None and bool(judge.joins_exactly(settings))
    if spec.blocks_end_at_prompt:
        # A joined row restarts with what is left of its max_tokens; when that is not whole
        # blocks, its short last block would share columns with a longer row's masks, which it
        # attends to (block-causal within the block) and which a run of its own does not have.
        joins = joins and settings.max_tokens % settings.block_length == 0
    kind = judge.kv_kind(settings) if judge is not None else None
    # Rows draw from streams of their own seeds unless the backend draws for the whole batch.
    own_streams = decoder.row_seeds and not (backend is not None and backend.draws_batch_wide)
    return Batching(joins, joins and not judge.join_reencodes, drops, kind, own_streams)


def select_decoder(spec: DiffusionSpec, settings) -> Type[Decoder]:
    """The loop of the `mode` setting or the spec's `decoder`: the family's own (`spec.decoders`),
    else the shared table's."""
    name = settings.mode or spec.decoder
    table = {**DECODERS, **spec.decoders}
    if name not in table:
        raise SettingsError(
            f"mode {name!r} is not available for the {spec.family} family; "
            f"choose one of: {', '.join(sorted(table))}"
        )
    return table[name]


def draws_noise(spec: DiffusionSpec, settings) -> bool:
    """Whether a run of these (resolved) settings draws from the seed's stream, so that its seed
    changes its tokens: sampling at temperature > 0, or what its loop declares (`Decoder.draws`:
    the masked loop's commit rule, e.g. random remasking or Dream's and Dimple's random orders,
    and the canvas's noise)."""
    spec = for_settings(spec, settings)
    return settings.temperature > 0 or select_decoder(spec, settings).draws(spec, settings)


def check_constraints(spec: DiffusionSpec, settings) -> None:
    """A SettingsError unless the decoder of these settings takes structured-output constraints
    (it declares `takes_constraints`); its `constraint_alternative` says what to do instead."""
    decoder = select_decoder(spec, settings)
    if not decoder.takes_constraints:
        raise SettingsError(
            f"structured output (json_schema / regex / lark) is not supported by the "
            f"{spec.family} family's {settings.mode or spec.decoder} decoder "
            f"({decoder.__name__}); "
            f"{decoder.constraint_alternative}"
        )
    if settings.max_thinking_tokens is not None:
        raise SettingsError(
            "a constraint (json_schema / regex / lark) and the thinking budget "
            "(max_thinking_tokens) cannot go together: the budget forces end_think_token_id into "
            "the text, where the grammar may not allow it; drop one of them"
        )


def make_decoder(
    model,
    settings,
    eos_token_ids,
    images=None,
    eot_token_id=None,
    suffix=(),
    row_seeds=None,
    constraints=None,
) -> Decoder:
    """The decoding loop for a model and resolved settings, with its backend (build_decoder of
    the DecoderInputs these make): `images` (the processor's pixel values) for a decoder that
    `reads_images`; `eot_token_id` (LLaDA's confidence_eos_eot_inf) and `suffix` (infilling) for
    the masked decoder; `row_seeds` (a seed per row) for a decoder whose rows draw from streams of
    their own (Batching.row_seeds); `constraints` (structured output, one structured.Constraint
    or None per row) for a decoder that declares `takes_constraints`, and a SettingsError from
    any other."""
    inputs = DecoderInputs(
        spec=for_settings(model.diffusion_spec, settings),
        settings=settings,
        eos_token_ids=set(eos_token_ids),
        pixel_values=images,
        eot_token_id=eot_token_id,
        suffix=list(suffix),
        constraints=constraints,
        row_seeds=None if row_seeds is None else list(row_seeds),
    )
    return build_decoder(model, inputs)


def build_decoder(model, inputs: DecoderInputs) -> Decoder:
    """The decoding loop of `inputs` (a request.Request is one) for `model`, with its backend."""
    spec, settings = inputs.spec, inputs.settings
    decoder = select_decoder(spec, settings)
    if inputs.constraints is not None:
        check_constraints(spec, settings)
    if inputs.pixel_values is not None and not decoder.reads_images:
        raise TypeError(f"{decoder.__name__} reads no pixel values: the images belong in the ids")
    return decoder(model, inputs, select_backend(spec, settings))
