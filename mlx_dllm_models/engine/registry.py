"""The engine's two tables, as plain literals: which backend computes a block's logits for an
attention layout and a `cache` setting, and which decoding loop a family (or its `mode`) runs.

"auto" is a layout's first cache: the exact cache where the layout allows one, else full recompute.
A layout's cache choices are exactly its rows here, so validation, the error message and the
decoders read one truth.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..settings import SettingsError
from ..spec import (
    BIDIRECTIONAL,
    BLOCK_CAUSAL,
    CAUSAL_PREFIX,
    CAUSAL_WINDOW,
    ENCODER_CANVAS,
    PREFIX_DLM,
    for_settings,
)
from .block_cache import PrefixCache
from .canvas import CanvasDecoder
from .causal_prefix import CausalPrefixCache, CausalPrefixRecompute
from .fast_dllm import ApproxPrefixCache, DualCache
from .full_recompute import FullRecompute
from .masked import MaskedBlockDecoder
from .prefill import PrefillCache
from .prefix_dlm import PrefixDLMCache
from .self_spec import SelfSpeculativeDecoder
from .sub_block_cache import SubBlockCache
from .wedlm import WeDLMDecoder, WindowKV, WindowRecompute

# attention layout -> {cache setting: backend class}, the layout's default ("auto") first.
BACKENDS: Dict[str, Dict[str, type]] = {
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
    # WeDLM's window over a causal K/V cache, or every forward over the whole row.
    CAUSAL_WINDOW: {"prefix": WindowKV, "none": WindowRecompute},
    # LaViDa's two modes: prefix_lm=True, the prompt's K/V kept (exact: the prompt never attends
    # to the answer; the README's "KV cache on"), or prefix_lm=False, every forward over the whole
    # sequence attending everywhere ("KV cache off", as LLaDA's and Dream's own generate).
    PREFIX_DLM: {"prefix": PrefixDLMCache, "none": FullRecompute},
}

# Decoding loops by name: a family's spec names its default (`DiffusionSpec.decoder`); its `mode`
# setting, where it has one, can pick another (Nemotron's self-speculation).
DECODERS: Dict[str, type] = {
    "masked": MaskedBlockDecoder,
    "diffusion": MaskedBlockDecoder,
    "self_spec": SelfSpeculativeDecoder,
    "canvas": CanvasDecoder,
    "wedlm": WeDLMDecoder,
}


def cache_choices(attention: str) -> Tuple[str, ...]:
    return ("auto",) + tuple(sorted(BACKENDS[attention]))


def select_backend(spec, settings):
    """The backend class for the spec's layout and the `cache` setting (None for a layout whose
    decoder keeps its own cache)."""
    spec = for_settings(spec, settings)  # a sampler may bring its layout (dllm's bd3lm)
    table = BACKENDS[spec.attention]
    cache = settings.get("cache") or "auto"
    if cache == "auto":
        return next(iter(table.values()), None)
    if cache not in table:
        raise SettingsError(
            f"cache={cache!r} is not available for the {spec.family} family "
            f"({spec.attention} attention); choose one of: {', '.join(cache_choices(spec.attention))}"
        )
    backend = table[cache]
    check = getattr(backend, "check_settings", None)
    if check is not None:
        check(spec, settings)  # settings a backend cannot honour fail before decoding starts
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


def join_policy(spec, settings) -> Batching:
    """What the decoder and backend of these (resolved) settings declare: a decoder whose run
    drops cancelled rows before its next step says `drops_cancelled_rows` (every decoder today);
    rows join where a restart over [prompt ; committed] with per-row budgets reproduces the run:
    the backend says `joins_exactly(settings)` (a decoder may say it itself; the canvas and WeDLM
    decoders, which take no budgets, have no backend that does)."""
    decoder = select_decoder(spec, settings)
    drops = getattr(decoder, "drops_cancelled_rows", False)
    backend = select_backend(spec, settings) if drops else None
    # A decoder that judges its own restarts says so (self-speculation's rows are AR decoding,
    # whatever the backend's blocks); else its backend does.
    judge = decoder if hasattr(decoder, "joins_exactly") else backend
    exact = getattr(judge, "joins_exactly", None)
    joins = bool(exact is not None and exact(settings))
    if for_settings(spec, settings).blocks_end_at_prompt:
        # A joined row restarts with what is left of its max_tokens; when that is not whole
        # blocks, its short last block would share columns with a longer row's masks, which it
        # attends to (block-causal within the block) and which a run of its own does not have.
        joins = joins and settings["max_tokens"] % settings["block_length"] == 0
    kind = getattr(judge, "kv_kind", None)
    kind = kind(settings) if kind is not None else None
    # Rows draw from streams of their own seeds unless the backend draws for the whole batch.
    own_streams = getattr(decoder, "row_seeds", False)
    own_streams = own_streams and not getattr(backend, "draws_batch_wide", False)
    return Batching(joins, joins and not judge.join_reencodes, drops, kind, own_streams)


def select_decoder(spec, settings):
    name = settings.get("mode") or spec.decoder
    if name not in DECODERS:
        raise SettingsError(
            f"mode {name!r} is not available for the {spec.family} family; "
            f"choose one of: {', '.join(sorted(DECODERS))}"
        )
    return DECODERS[name]


def check_constraints(spec, settings) -> None:
    """A SettingsError unless the decoder of these settings takes structured-output constraints
    (it declares `takes_constraints`); its `constraint_alternative` says what to do instead."""
    decoder = select_decoder(spec, settings)
    if not getattr(decoder, "takes_constraints", False):
        raise SettingsError(
            f"structured output (json_schema / regex / lark) is not supported by the "
            f"{spec.family} family's {settings.get('mode') or spec.decoder} decoder "
            f"({decoder.__name__}); "
            f"{getattr(decoder, 'constraint_alternative', 'drop the constraint')}"
        )
    if settings.get("max_thinking_tokens") is not None:
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
):
    """The decoding loop for a model and resolved settings, with its backend; `images` (the
    processor's pixel values) go to the decoder of a family that reads them; `eot_token_id` (LLaDA's
    confidence_eos_eot_inf) and `suffix` (infilling) to the masked decoder; `row_seeds` (a seed
    per row) to a decoder whose rows draw from streams of their own (Batching.row_seeds);
    `constraints` (structured output, one structured.Constraint or None per row) to a decoder
    that declares `takes_constraints`, and a SettingsError from any other."""
    spec = model.diffusion_spec
    decoder = select_decoder(spec, settings)
    extra = {} if images is None else {"images": images}
    if constraints is not None:
        check_constraints(spec, settings)
        extra["constraints"] = constraints
    if row_seeds is not None:
        extra["row_seeds"] = row_seeds
    if eot_token_id is not None:
        extra["eot_token_id"] = eot_token_id
    if suffix:
        extra["suffix"] = suffix
    return decoder(model, settings, eos_token_ids, backend=select_backend(spec, settings), **extra)
