"""The engine's contracts: what a backend and a decoder declare and do, as types.

Every capability is a typed attribute on a shared base class, with its default there: the registry
(join_policy, select_backend, check_constraints) and the loops read `cls.flag`, never a flag that
may be missing. A backend of the masked block engine also follows `BlockBackend`, WeDLM's window
backends `WindowBackend`; every decoder follows `Decoder` and is built from `DecoderInputs` (what
request.prepare resolved: request.Request is one).

Restarts (the server's joins): a run may take rows that arrive while it goes on by restarting over
[prompt ; committed] with each row's budget left; `joins_exactly(settings)` says whether that
reproduces the run, `join_reencodes` whether the restart recomputes K/V the run had kept, and
`kv_kind(settings)` the kind of cache.PriorKV a one-row run leaves and can resume from (None:
nothing reusable). The backend judges, unless its decoder `judges_joins` (self-speculation).
"""

from dataclasses import dataclass, field
from typing import (
    AbstractSet,
    Any,
    ClassVar,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Set,
    Tuple,
)

import mlx.core as mx

from ..cache import PriorKV
from ..settings import SettingsError
from ..settings_fields import ResolvedSettings
from ..spec import DiffusionSpec

# A batch's prompts (token ids, one list a row), and a set of its rows (by index).
Prompts = Sequence[Sequence[int]]
Rows = AbstractSet[int]


class Restarts:
    """What a backend or a decoder says about restarting its rows (see the module docstring)."""

    join_reencodes: ClassVar[bool] = True

    @classmethod
    def joins_exactly(cls, settings: ResolvedSettings) -> bool:
        return False

    @classmethod
    def kv_kind(cls, settings: ResolvedSettings) -> Optional[str]:
        return None


class ExactRestarts(Restarts):
    """Restarts of a backend whose restart over [prompt ; committed] reproduces the run under any
    settings: every forward recomputes from the tokens, or the blocks keep their absolute
    positions and their K/V."""

    @classmethod
    def joins_exactly(cls, settings: ResolvedSettings) -> bool:
        return True


class Backend(Restarts):
    """The base of every backend in engine.registry.BACKENDS: its capabilities, their defaults."""

    # It runs LLaDA's classifier-free guidance (cfg_scale): unconditional rows in its forwards.
    guidance: ClassVar[bool] = False
    # Its `select(layout, rows)` is a view the engine may run a step's forward on when only those
    # rows have masks left in the block (nothing a later forward reads is kept by that forward).
    row_steps: ClassVar[bool] = False
    # It draws tokens from one key for the whole batch: rows of different seeds cannot share a run.
    draws_batch_wide: ClassVar[bool] = False
    # `resume(x, prior)` prefills over an earlier run's K/V (cache.PriorKV), one prompt at a time.
    resumes: ClassVar[bool] = False
    # Prompt columns whose K/V came from an earlier run (resume).
    reused: int = 0
    # (B, V) log-probabilities of the position the backend seeded in the open block (a column no
    # denoising step decides), with the logprobs setting; None: it seeded none.
    seed_log_probs: Optional[mx.array] = None

    @classmethod
    def check_settings(cls, spec: DiffusionSpec, settings: ResolvedSettings) -> None:
        """Refuse (SettingsError), before decoding starts, settings the backend cannot honour."""

    def resume(self, x: mx.array, prior: PriorKV) -> None:
        raise SettingsError(f"{type(self).__name__} keeps no K/V to resume from")

    def kv_prefix(self, x: mx.array) -> Optional[PriorKV]:
        """The K/V a finished one-row run leaves final (None: none reusable)."""
        return None


class BlockBackend(Protocol):
    """A backend of the masked block engine (engine.masked), built as
    `Backend(model, spec, layout, settings)`: full_recompute.py's docstring states the methods."""

    nfe: int
    guidance: ClassVar[bool]
    row_steps: ClassVar[bool]
    resumes: ClassVar[bool]
    reused: int
    seed_log_probs: Optional[mx.array]

    def prefill(self, x: mx.array) -> None: ...

    def resume(self, x: mx.array, prior: PriorKV) -> None: ...

    def begin_block(self, x: mx.array, start: int, stop: int) -> mx.array: ...

    def block_logits(self, x: mx.array, start: int, stop: int) -> mx.array: ...

    def end_block(self, x: mx.array, start: int, stop: int) -> None: ...

    def select(self, layout: Any, rows: List[int]) -> "BlockBackend": ...

    def kv_prefix(self, x: mx.array) -> Optional[PriorKV]: ...


class WindowBackend(Protocol):
    """A backend of WeDLM's window decoder (engine.wedlm), built as `Backend(model, rows, width)`:
    `logits(batch)` of each row's window, `commit(row, column)` of its kept K/V, `select(rows)`."""

    def logits(self, batch: Sequence) -> List[mx.array]: ...

    def commit(self, row: int, column: int) -> None: ...

    def select(self, rows: Sequence[int]) -> "WindowBackend": ...


@dataclass
class DecoderInputs:
    """What a decoder is built with, resolved once (request.prepare, or engine.make_decoder)."""

    # The spec the run decodes under: the family's with the fields its sampler brings
    # (spec.for_settings), never recomputed by a decoder.
    spec: DiffusionSpec
    settings: ResolvedSettings  # every setting of the family, validated
    eos_token_ids: Set[int] = field(default_factory=set)
    pixel_values: Optional[List[Any]] = None  # per row, None for a row without images
    eot_token_id: Optional[int] = None  # LLaDA's confidence_eos_eot_inf
    suffix: List[int] = field(default_factory=list)  # infilling: ids after the generated span
    # Structured output: per row, a structured.Constraint or None; None when no row has one.
    constraints: Optional[List[Any]] = None
    # Per row, the seed of its own stream (a decoder with `row_seeds`); None: the seed setting.
    row_seeds: Optional[List[int]] = None


class Decoder(Restarts):
    """The base of every decoder in engine.registry.DECODERS: its capabilities, their defaults.
    A decoder is built as `Decoder(model, inputs, backend)` (`backend`: the class the registry
    picked for the layout and `cache` setting, None where the layout has none) and decodes with
    `run(prompts, cancelled=, constraints=, consumed=)`, a generator of engine.base events; a
    decoder whose joins may be exact takes `budgets=` too, and one with a `kv_kind`, `prior=`."""

    # `run(cancelled=)` drops a cancelled row before its next denoising step.
    drops_cancelled_rows: ClassVar[bool] = False
    # Each row draws from a stream of its own seed (DecoderInputs.row_seeds).
    row_seeds: ClassVar[bool] = False
    # Rows may carry structured-output constraints (DecoderInputs.constraints, run(constraints=)).
    takes_constraints: ClassVar[bool] = False
    # What the refusal of a constraint tells the user to do instead.
    constraint_alternative: ClassVar[str] = "drop the constraint"
    # It reads the processor's pixel values (DecoderInputs.pixel_values).
    reads_images: ClassVar[bool] = False
    # Whether a restart reproduces a run is the decoder's own judgement (its Restarts methods),
    # not its backend's.
    judges_joins: ClassVar[bool] = False
    # The `sampler` setting's names this loop implements itself (the masked loop's rules are
    # decoding.samplers.commit_rule's instead).
    samplers: ClassVar[Tuple[str, ...]] = ()
    # Model forwards so far.
    nfe: int = 0
    # The events carry each step's confidence (StepEvent's; self-speculation's BlockEvent's) only
    # when a consumer asks (trace.py sets it): an unread statistic would hold the step's logits
    # alive into the next forward (self-speculation: one more read a round).
    step_confidence: bool = False

    @classmethod
    def draws(cls, spec: DiffusionSpec, settings: ResolvedSettings) -> bool:
        """Whether a run of these settings draws from the seed's stream beyond the token sampling
        of temperature > 0 (which every loop does), so that the seed changes its tokens."""
        return False

    @property
    def reused(self) -> int:
        """Prompt columns whose K/V the last run took from its `prior`."""
        return 0

    def kv_prefix(self) -> Optional[PriorKV]:
        """The K/V the last run left final, for a later run's `prior` (None: none reusable)."""
        return None

    def run(
        self,
        prompts: Prompts,
        *,
        cancelled: Rows = frozenset(),
        constraints: Optional[Sequence] = None,
        consumed: Optional[Sequence] = None,
    ) -> Iterator[object]:
        raise NotImplementedError
