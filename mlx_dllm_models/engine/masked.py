"""Masked block decoding, the engine's main loop. The loop owns state; rules (decoding/) are pure;
families differ only through their DiffusionSpec and the backend the registry picks for their
attention layout and `cache` setting (full_recompute.py documents a backend's interface). The
sampler setting names the commit rule (decoding.samplers.commit_rule: the family's own, else the
shared table's); the row layout is layout.py's, token editing editing.py's.

Masked block decoding (LLaDA, LLaDA-MoE, Dream, and the block-causal families through their
backend): the generated region starts as mask tokens and is decoded block by block; each step
proposes a token for every mask of the current block and a commit rule, with a per-step quota floor
from the schedule, commits some of them. The floor sums to the block's mask count over `steps`, so a
block always completes within its step budget and no mask ever reaches the output. Families that
declare `editing_threshold` (LLaDA2.1) also rewrite committed tokens of the open block, during its
steps and for up to `max_post_steps` forwards after its last mask (token editing); a row's editing
stops early at a step that edits nothing, or that brings its maskless block back to a state it held
before (edits that flip-flop would otherwise cycle until max_post_steps). A family that also
declares edit_token_ids (LLaDA2.2) decodes with its own fill rule and DELETE / SPLIT edits, which
move a block's tokens and bring masks back (editing.LevenshteinEditing).

`run` is a generator over blocks (`_block`: a StepEvent per forward, then the block's BlockEvent),
each of whose steps is a forward (`_forward`, over the rows that still have masks), the statistics
and the rule's commit (`_commit`), and the update of the candidates (`_settle`), whose one host read
decides the next step.

Rows leave the batch between two steps as well as between blocks (`run(cancelled=)`, the server's
disconnected clients): the batch's state, the backend's (its K/V rows: `select(layout, rows)`) and
the open block's are cut to the other rows, which decode on as a smaller batch. A row's forward,
statistics and commit read its own row only, so the others' tokens are those of a run without it.

Work is bounded by the block, not by the settings: a schedule holds only the steps that can commit
(`steps` above a block's mask count adds no column and no forward), and the first forward's logits
are checked to be finite (corrupt weights are an error naming the checkpoint, not garbage output).
"""

import logging
from dataclasses import dataclass
from typing import AbstractSet, Iterator, List, Optional, Sequence, Type

import mlx.core as mx

from ..decoding import token_stats
from ..decoding.d3llm import fill_after_eos
from ..decoding.llada import confidence_suppressed_ids
from ..decoding.samplers import StepContext, commit_rule
from ..decoding.stats import without
from ..settings import SettingsError
from ..spec import BLOCK_CAUSAL
from .base import BlockEvent, StepEvent, block_event, check_finite, placed, split_rows
from .constrained import RowConstraints, make_row_constraints
from .contracts import Backend, BlockBackend, Decoder, DecoderInputs
from .editing import BlockEditing
from .layout import Layout
from .logprobs import PositionLogprobs

logger = logging.getLogger(__name__)
_WARNED_BLOCK_LENGTHS = set()


def _warn_untrained_block_length(spec, settings):
    """Block-causal checkpoints are trained with one block size; another one runs, but quality
    depends on it. Said once per process for each (family, trained, chosen) size."""
    trained, chosen = spec.trained_block_length, settings.block_length
    key = (spec.family, trained, chosen)
    if trained is None or chosen == trained or key in _WARNED_BLOCK_LENGTHS:
        return
    _WARNED_BLOCK_LENGTHS.add(key)
    logger.warning(
        "block_length=%d differs from the block size %d this %s checkpoint was trained with; "
        "generation runs, but its quality may drop",
        chosen,
        trained,
        spec.family,
    )


def _past_eos(block, cand, gen, eos) -> mx.array:
    """(B, L) the positions at or after the first EOS among a block's decoded positions."""
    is_eos = mx.zeros(block.shape, dtype=mx.bool_)
    for e in eos:
        is_eos = is_eos | (block == e)
    is_eos = is_eos & gen & ~cand
    return mx.cumsum(is_eos.astype(mx.int32), axis=-1) > 0


def _settled_by_eos(block, cand, gen, eos) -> mx.array:
    """(B,) rows whose block holds an EOS among its decoded positions with no mask before it:
    nothing after that EOS is ever returned, so the row's block is done (Nemotron's generate)."""
    seen = _past_eos(block, cand, gen, eos)
    return seen.any(axis=-1) & ~(cand & ~seen).any(axis=-1)


def _seeded_block_candidates(window, cand, gen, layout, lo: int, stop: int, decoder) -> mx.array:
    """A seeded block's candidates (`spec.seeds_block_start`: Fast-dLLM v2), none for a row that
    its seed finished: the seed is EOS (under `eos_ends_block`), or the last column the row
    returns. The reference's generate stops there: its finished block's forward gave that token,
    and it opens no block after it."""
    wanted = cand & layout.generated[:, lo:stop]
    if decoder.spec.eos_ends_block and decoder.eos:
        wanted = wanted & ~_settled_by_eos(window, cand, gen, decoder.eos)[:, None]
    return cand & wanted.any(axis=1, keepdims=True)


def _prepend_infill(event: BlockEvent, layout: Layout, x: mx.array, lo: int, window) -> None:
    """The masks of a prompt are all filled with the first block (its quota counted them): a row's
    returned span starts at its prompt's first mask. `window`: each row's TokenLogprobs of the
    block's window, which starts at column `lo` (None without the logprobs setting)."""
    for i, toks in enumerate(event.tokens):
        where = layout.infill[i].tolist()
        if True in where:
            first = where.index(True)
            toks[:0] = x[i, first : layout.starts[i]].tolist()
            if window is not None:
                event.logprobs[i][:0] = window[i][first - lo : layout.starts[i] - lo]


@dataclass
class _Batch:
    """What a run carries from block to block."""

    x: mx.array  # (B, W) the tokens of the rows still in the batch
    rows: List[int]  # their indices among the run's prompts
    layout: Layout  # of those rows
    backend: BlockBackend  # over those rows
    key: mx.array  # (B, 2) each row's PRNG key, split once per step
    first: int  # the leftmost column where a row's canvas starts: StepEvents show from there
    checked: bool = False  # the first forward's logits were checked to be finite
    constraints: Optional[RowConstraints] = None  # the rows' grammar matchers (structured output)


@dataclass
class _Block:
    """The open block's state between its steps."""

    start: int
    stop: int
    lo: int  # the candidate window is [lo, stop): the block, and masks left inside a prompt
    gen: mx.array  # (B, stop - lo) the window's positions that the rows decode
    cand: mx.array  # (B, stop - lo) the masks left among them
    schedule: mx.array  # (B, K) the rows' quota floors of the block's first K steps
    floor_max: List[int]  # the schedule's per-step maxima, on the host
    rows_left: List[int]  # rows with masks left, on the host (kept up to date without editing)
    editing: Optional[BlockEditing]  # token editing, for families that declare it
    part: Optional[tuple] = None  # (rows, their backend view) while only some rows have masks left
    logprobs: Optional[PositionLogprobs] = None  # the window's, with the logprobs setting
    confidence: Optional[mx.array] = None  # (B, stop - lo) the last step's, NaN for rows it skipped


class MaskedBlockDecoder(Decoder):
    """Masked block decoding for a batch of prompts (B >= 1). The loop is the same for every
    family; what differs (how logits of a block are computed, caches, block seeding) lives in the
    backend, a class that engine.registry picks from the spec's attention layout and the `cache`
    setting. The rows, budgets and restarts (`run(budgets=, prior=)`) are its backend's to judge."""

    # `run(cancelled=)` drops a cancelled row before its next denoising step, and `run(budgets=)`
    # restarts rows over [prompt ; committed] with what is left of their max_tokens (the server's
    # joins).
    drops_cancelled_rows = True
    # Structured output: rows may carry grammar constraints (engine/constrained.py).
    takes_constraints = True
    # Every draw (temperature, Dream's alg_temp, random remasking) comes from a stream per row,
    # seeded by the row's seed (`row_seeds`, default the seed setting): a row samples as it would
    # alone, whatever its batch-mates, and rows of different seeds may share a run.
    row_seeds = True

    @classmethod
    def draws(cls, spec, settings) -> bool:
        """The commit rule's draws (random remasking, Dream's origin or alg_temp, ...)."""
        rule = commit_rule(spec, settings.sampler)
        return rule is not None and bool(rule.draws(settings))

    def __init__(self, model, inputs: DecoderInputs, backend: Type[Backend]):
        self.model = model
        settings, seeds = inputs.settings, inputs.row_seeds
        # Each row's seed (default: the seed setting for every row): see `row_seeds` below.
        self.seeds = None if seeds is None else [int(seed) for seed in seeds]
        # Structured output: each row's structured.Constraint (None: unconstrained), or None.
        self.constraints = inputs.constraints
        self.spec = inputs.spec
        self.s = settings
        self.eos = set(int(e) for e in inputs.eos_token_ids)
        self.suffix = list(inputs.suffix)  # infilling: the tokens after every row's canvas
        if settings.cfg_scale and not backend.guidance:
            raise SettingsError(
                f"cfg_scale is not supported with cache={settings.cache!r}: guidance runs "
                "the unconditional rows beside the conditional ones in each forward, which that "
                "backend does not; pass cache='none' or drop cfg_scale"
            )
        # LLaDA generate.py's Appendix B.4 options: logits_eos_inf touches the checkpoint's EOS
        # (config.json's eos_token_id, upstream's 126081), confidence_eos_eot_inf its end of turn
        # (upstream's 126348, <|eot_id|>), resolved from the tokenizer by the caller.
        self.logits_suppressed = self.spec.eos_token_ids if settings.logits_eos_inf else ()
        self.logits_suppressed += self.spec.logit_suppressed_token_ids
        self.confidence_suppressed = ()
        if settings.confidence_eos_eot_inf:
            if inputs.eot_token_id is None:
                raise ValueError("confidence_eos_eot_inf needs the end-of-turn token id")
            self.confidence_suppressed = confidence_suppressed_ids(
                self.spec.eos_token_ids, inputs.eot_token_id, settings.temperature
            )
        self.backend_cls = backend
        self.backend: Optional[BlockBackend] = None
        self.tokens = None  # the last run's (B, W) tokens, for kv_prefix
        rule = commit_rule(self.spec, settings.sampler)
        if rule is None:
            raise ValueError(f"sampler {settings.sampler!r} has no commit rule in the engine")
        self.rule = rule
        self.schedule = rule.schedule
        self.exact_floor = bool(rule.exact_floor(settings))
        # A rule that re-masks committed tokens (Open-dCoder's p2) returns (commit, reopen).
        self.reopens = rule.reopens
        self.fills_after_eos = bool(rule.fills_after_eos(settings)) and bool(self.eos)
        # Alternatives listed per token (None: no log-probabilities); never the ids a step cannot
        # propose.
        self.top_logprobs = settings.logprobs
        self.unproposed = (self.spec.mask_token_id, *self.spec.suppressed_token_ids)
        _warn_untrained_block_length(self.spec, settings)

    @property
    def nfe(self) -> int:
        return self.backend.nfe if self.backend is not None else 0

    @property
    def reused(self) -> int:
        return self.backend.reused if self.backend is not None else 0

    def kv_prefix(self):
        """The K/V the last run left final, as a cache.PriorKV for `run(prompts, prior=...)` of a
        prompt that continues its tokens (a chat's next turn); None when the backend keeps no K/V
        (full recompute: bidirectional families recompute everything every step anyway) or the
        run had more than one row left."""
        if self.backend is None or self.tokens is None or self.tokens.shape[0] != 1:
            return None
        return self.backend.kv_prefix(self.tokens)

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        budgets: Optional[Sequence[int]] = None,
        cancelled: AbstractSet[int] = frozenset(),
        prior=None,
        constraints: Optional[Sequence] = None,
        consumed: Optional[Sequence] = None,
    ) -> Iterator[object]:
        """Decode `prompts` (left-padded into one batch), yielding StepEvents and BlockEvents.
        `budgets`: each row's max_tokens (default: the max_tokens setting for every row).
        `cancelled`: a set of row indices the caller may grow while the run goes on (between two
        of its events); a row in it leaves the batch before the next denoising step, with no
        further event (the server's disconnected clients): from that step on every forward is
        over the other rows only, whose tokens stay those of a run without it. A run whose rows
        are all cancelled ends (the generator returns).
        `prior`: a cache.PriorKV from an earlier run (see `kv_prefix`) whose K/V the prefill reuses
        over the prefix the (single) prompt shares with it; the tokens are those of a run without
        it. Backends with a KV cache only (block-causal and causal-prefix families).
        `constraints`: each row's structured.Constraint (None: unconstrained; default: the
        decoder's), `consumed` the tokens each has already returned (a row the server restarts
        over [prompt ; committed]: its grammar continues after them)."""
        constraints = self.constraints if constraints is None else constraints
        constrained = constraints is not None and any(c is not None for c in constraints)
        if self.reopens and constrained:
            raise SettingsError(
                f"sampler {self.s.sampler!r} re-masks committed tokens, which a grammar "
                "constraint cannot take back; use another sampler for structured output"
            )
        if constrained and self.spec.edit_token_ids and self.s.editing_threshold is not None:
            raise SettingsError(
                "LLaDA2.2's insert/delete edits move and re-mask committed tokens, which a grammar "
                "constraint cannot take back; use editing_mode='off' for structured output"
            )
        batch = self._start(prompts, budgets, prior)
        batch.constraints = make_row_constraints(
            constraints, consumed, self.eos, self.spec.mask_token_id
        )
        # (request.prepare refuses constraints with masks inside a prompt: open_block treats
        # the window as the block's own columns.)
        for start, stop in batch.layout.blocks():
            event = yield from self._block(batch, start, stop, cancelled)
            if event is None:  # every row was cancelled
                return
            self.tokens = batch.x
            yield event
            if not self._keep_rows(batch, event, cancelled):
                return

    def _start(self, prompts, budgets, prior) -> _Batch:
        """The batch's layout and backend, prefilled (over `prior`'s K/V, where given)."""
        s, spec = self.s, self.spec
        layout = Layout(
            prompts,
            s.max_tokens if budgets is None else budgets,
            s.block_length,
            spec.attention == BLOCK_CAUSAL,
            spec.mask_token_id,
            suffix=self.suffix,
            prompt_end=spec.blocks_end_at_prompt,
            cut_last_block=spec.last_block_at_max_tokens,
        )
        x = layout.tokens
        backend = self.backend = self.backend_cls(self.model, spec, layout, s)
        self.tokens = None
        if prior is None:
            backend.prefill(x)
        else:
            if not backend.resumes or len(prompts) != 1:
                raise SettingsError(
                    f"{type(backend).__name__} cannot reuse an earlier run's K/V "
                    f"({'one prompt at a time' if backend.resumes else 'it keeps none'}); "
                    "run without prior"
                )
            backend.resume(x, prior)
        seeds = self.seeds or [s.seed] * len(prompts)
        key = mx.stack([mx.random.key(seed) for seed in seeds])
        return _Batch(x, list(range(len(prompts))), layout, backend, key, min(layout.starts))

    def _block(self, batch: _Batch, start: int, stop: int, cancelled: AbstractSet[int]):
        """Decode one block: yields a StepEvent after each step's forward, returns the block's
        BlockEvent (None once every row was cancelled)."""
        blk = self._open_block(batch, start, stop)
        first, editing = batch.first, blk.editing
        # A constrained row commits one column a step at least, whatever its schedule: it may
        # need as many steps as the window has columns.
        extra = stop - blk.lo if batch.constraints is not None else 0
        # A block that opens with no candidate in any row (its seeds finished every row) takes
        # no step, whatever its schedule.
        steps = (editing.step_bound(self.s.steps) if editing else self.s.steps) + extra
        for step in range(steps if editing is not None or any(blk.rows_left) else 0):
            if cancelled and not self._drop_cancelled(batch, blk, cancelled):
                return None
            if editing is not None:
                if not editing.continues(blk.cand):
                    break
            elif batch.constraints is not None:
                if not any(blk.rows_left):
                    break
            elif self.exact_floor and step >= len(blk.floor_max):
                break  # past the schedule's columns every floor is 0: nothing more commits
            elif self.exact_floor and blk.floor_max[step] == 0:
                continue  # nothing to commit: the reference's forward would change nothing
            elif not any(blk.rows_left):
                break
            self._step(batch, blk, step)
            # The view ends at max_tokens: decoded positions past it are never returned.
            view = batch.x[:, first : max(batch.layout.ends)]
            conf = None
            if blk.confidence is not None:
                conf = placed(blk.confidence, blk.lo - first, view.shape[1])
            yield StepEvent(batch.rows, view, (start - first, stop - first), self.nfe, conf)
        return self._close_block(batch, blk)

    def _open_block(self, batch: _Batch, start: int, stop: int) -> _Block:
        s, mask_id = self.s, self.spec.mask_token_id
        batch.x = x = batch.backend.begin_block(batch.x, start, stop)
        layout = batch.layout
        # The candidate window [lo, stop): the block, and masks left inside a prompt. Its quota
        # counts both, so that every mask is filled; LLaDA's generate.py counts only the block's,
        # and would end with as many masks as the prompt held.
        lo = layout.window_start(x, mask_id, start)
        if self.spec.whole_block_window:
            lo = min(lo, start - start % s.block_length)
        if batch.constraints is not None:
            batch.x = x = batch.constraints.open_block(x, lo, stop, layout)
        gen = layout.decoded[:, lo:stop] | layout.infill[:, lo:stop]
        cand = (x[:, lo:stop] == mask_id) & gen
        if self.spec.seeds_block_start:
            cand = _seeded_block_candidates(x[:, lo:stop], cand, gen, layout, lo, stop, self)
        if self.spec.quota_base == "masks":
            base = cand.sum(axis=1)
        else:
            base = mx.full((x.shape[0],), s.block_length, mx.int32)
        schedule = self.schedule(base, s.steps, s)
        editing = BlockEditing.open(s, self.spec, cand)
        # Host reads stall the device: one per step at most. The block's first read brings which
        # rows have a candidate and the schedule's per-step maxima (a step whose floor is 0
        # everywhere is skipped without a forward); then, without editing, each step ends with
        # one read of which rows have masks left (_settle).
        n = x.shape[0]
        first_read = mx.concatenate(
            [cand.any(axis=1).astype(mx.int32), schedule.max(axis=0).astype(mx.int32)]
        ).tolist()
        floor_max, rows_left = first_read[n:], first_read[:n]
        blk = _Block(start, stop, lo, gen, cand, schedule, floor_max, rows_left, editing)
        if self.top_logprobs is not None:
            blk.logprobs = self._open_logprobs(batch, x, lo, start, stop)
        return blk

    def _open_logprobs(self, batch: _Batch, x, lo: int, start: int, stop: int):
        """The window's log-probability record; a backend that seeded the block's first column
        (the AR head of causal_prefix.py) gives that column's from its `seed_log_probs`."""
        lp = PositionLogprobs(self.top_logprobs, self.unproposed, x.shape[0], stop - lo)
        seeded = batch.backend.seed_log_probs
        if seeded is not None:
            column = (mx.arange(stop - lo) == start - lo)[None] & batch.layout.generated[
                :, start : start + 1
            ]
            lp.put(seeded[:, None], x[:, start : start + 1], column, never=())
        return lp

    def _step(self, batch: _Batch, blk: _Block, step: int) -> None:
        """One denoising step of the open block: a forward, the statistics, the commit (and the
        edits), the new candidates."""
        s, spec = self.s, self.spec
        logits, idx = self._forward(batch, blk)
        keys, k_stats, k_rule = split_rows(batch.key, 3)
        if blk.editing is None and not all(blk.rows_left):
            # A row without masks left takes no step: its stream stays where a run of that row
            # alone leaves it (which never steps a block it has finished, or not yet begun).
            keys = mx.where(mx.array(blk.rows_left, dtype=mx.bool_)[:, None], keys, batch.key)
        batch.key = keys
        suppress = (spec.mask_token_id, *spec.suppressed_token_ids)
        if blk.editing is not None:
            suppress = blk.editing.suppressed(suppress)
        stats = token_stats(
            logits,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            key=None if s.temperature == 0 else (k_stats if idx is None else k_stats[idx]),
            suppress_ids=suppress,
            confidence=spec.confidence,
            order=spec.sampling_order,
            extras=self.rule.stats_extras,
            confidence_suppress_ids=self.confidence_suppressed,
        )
        commit, x0, reopen = self._commit(stats, blk, step, k_rule, idx)
        if self.step_confidence:
            blk.confidence = stats.confidence
        if self.step_confidence and idx is not None:  # the rows the forward skipped have none
            blk.confidence = mx.full(blk.cand.shape, float("nan"), dtype=mx.float32)
            blk.confidence[idx] = stats.confidence.astype(mx.float32)
        current = batch.x[:, blk.lo : blk.stop]
        if batch.constraints is not None:
            # A key of its own for the first column's masked draw: the rule's stays as it was.
            k_first = split_rows(k_rule, 2)[1]
            commit, x0 = batch.constraints.commit(logits, idx, commit, x0, s, spec, k_first)
        if blk.editing is not None:
            edits = blk.editing.edits(stats, current, blk.gen, spec.mask_token_id)
            if batch.constraints is not None:  # a constrained row's tokens are never rewritten
                edits = edits & ~batch.constraints.row_mask()
            commit, x0 = blk.editing.revise(stats, logits, commit, x0, edits)
        block = mx.where(commit, x0.astype(mx.int32), current)
        if blk.editing is not None:
            block = blk.editing.apply(block, current, blk.gen)
        if reopen is not None:  # committed tokens the rule turns back into masks
            block = mx.where(reopen, spec.mask_token_id, block)
        if self.fills_after_eos:  # the positions after a row's first EOS are that EOS from now on
            block = fill_after_eos(block, blk.gen, self.eos)
        batch.x[:, blk.lo : blk.stop] = block
        if blk.logprobs is not None:
            rows = block if idx is None else block[idx]
            blk.logprobs.record(logits, rows, commit if idx is None else commit[idx], idx)
        self._settle(blk, block)

    def _forward(self, batch: _Batch, blk: _Block):
        """The step's logits over the window (EOS suppressed where asked), and the rows they are
        of: `idx`, or None for every row."""
        backend = batch.backend
        # A row whose block has no masks left commits nothing more: once some rows are there, the
        # step's forward runs over the others only (on a CPU a forward costs about its rows; a
        # batch would otherwise wait on its slowest row at full width).
        if blk.editing is None and not all(blk.rows_left) and backend.row_steps:
            sub = [i for i, r in enumerate(blk.rows_left) if r]
            if blk.part is None or blk.part[0] != sub:
                blk.part = (sub, backend.select(batch.layout.select(sub), sub))
            idx = mx.array(sub)
            logits = blk.part[1].block_logits(batch.x[idx], blk.lo, blk.stop)
            backend.nfe += 1
        else:
            idx = None
            logits = backend.block_logits(batch.x, blk.lo, blk.stop)
        if not batch.checked:  # corrupt weights show at the first forward (one host sync)
            check_finite(logits, self.model)
            batch.checked = True
        return without(logits, self.logits_suppressed), idx

    def _commit(self, stats, blk: _Block, step: int, key, idx):
        """The rule's (B, L) commit mask, the proposals and the positions it re-masks (None for
        a rule that never does); over the rows `idx` only, when the forward ran over those: their
        proposals in place, nothing committed elsewhere."""
        s, cand = self.s, blk.cand
        if step < blk.schedule.shape[1]:
            floor = blk.schedule[:, step]
        else:  # past the schedule's columns: no floor
            floor = mx.zeros((cand.shape[0],), mx.int32)
        if idx is None:
            ctx = StepContext(step, s.steps, floor, key, s, self.spec, blk.gen)
            commit, reopen = self._rule(stats, cand, ctx)
            return commit, stats.x0, reopen
        ctx = StepContext(step, s.steps, floor[idx], key[idx], s, self.spec, blk.gen[idx])
        sub, sub_reopen = self._rule(stats, cand[idx], ctx)
        commit = mx.zeros(cand.shape, dtype=mx.bool_)
        commit[idx] = sub
        x0 = mx.zeros(cand.shape, dtype=mx.int32)
        x0[idx] = stats.x0.astype(mx.int32)
        reopen = None
        if sub_reopen is not None:
            reopen = mx.zeros(cand.shape, dtype=mx.bool_)
            reopen[idx] = sub_reopen
        return commit, x0, reopen

    def _rule(self, stats, cand, ctx):
        """(commit, reopen) of the rule; reopen is None unless the rule re-masks."""
        out = self.rule(stats, cand, ctx)
        return out if self.reopens else (out, None)

    def _settle(self, blk: _Block, block: mx.array) -> None:
        """The block's candidates after a step's commit; without editing, the step's one host read
        of which rows have masks left."""
        cand = (block == self.spec.mask_token_id) & blk.gen
        if self.spec.eos_bounds_candidates and self.eos:
            cand = cand & ~_past_eos(block, cand, blk.gen, self.eos)
        if self.spec.eos_ends_block and self.eos:
            cand = cand & ~_settled_by_eos(block, cand, blk.gen, self.eos)[:, None]
        if blk.editing is not None:
            blk.editing.settle(block, cand)
        else:
            blk.rows_left = cand.any(axis=1).tolist()
        blk.cand = cand

    def _close_block(self, batch: _Batch, blk: _Block) -> BlockEvent:
        """The block's event, from its one host read."""
        x, layout, start, stop = batch.x, batch.layout, blk.start, blk.stop
        # One read: each row's returned tokens (-1 past max_tokens), then whether masks are left
        # (then, with the logprobs setting, the window's tokens and their log-probabilities).
        parts = [
            mx.where(layout.generated[:, start:stop], x[:, start:stop], -1),
            blk.cand.any(axis=1, keepdims=True).astype(x.dtype),
        ]
        n, width = stop - start, stop - blk.lo
        window = logprobs = None
        if blk.logprobs is None:
            read = mx.concatenate(parts, axis=1).tolist()
        else:
            parts = [a.astype(mx.float32) for a in parts + [x[:, blk.lo : stop]]]
            read = mx.concatenate(parts + [blk.logprobs.packed()], axis=1).tolist()
            tokens = [[int(t) for t in r[n + 1 : n + 1 + width]] for r in read]
            window = [blk.logprobs.unpack(r[n + 1 + width :], t) for r, t in zip(read, tokens)]
            read = [[int(t) for t in r[: n + 1]] for r in read]
            # The returned columns' entries: the window's from `start` on.
            logprobs = [
                [w[start - blk.lo + c] for c, t in enumerate(r[:n]) if t >= 0]
                for w, r in zip(window, read)
            ]
        assert not any(r[n] for r in read), "a block left masks after its step budget"
        batch.backend.end_block(x, start, stop)
        new = [[t for t in r[:n] if t >= 0] for r in read]
        at_limit = [stop >= end for end in layout.ends]
        event = block_event(batch.rows, new, at_limit, self.eos, self.nfe, logprobs)
        if layout.has_infill and blk.lo < start:
            _prepend_infill(event, layout, x, blk.lo, window)
        return event

    def _keep_rows(self, batch: _Batch, event: BlockEvent, cancelled) -> bool:
        """Drop the rows that finished or were cancelled from the batch; False when none is left."""
        rows = batch.rows
        keep = [i for i, f in enumerate(event.finished) if not f and rows[i] not in cancelled]
        if not keep:
            return False
        if len(keep) < len(rows):
            # Rows are independent: drop finished ones from the batch instead of computing them.
            batch.x = batch.x[mx.array(keep)]
            batch.key = batch.key[mx.array(keep)]
            batch.rows = [rows[i] for i in keep]
            batch.layout = batch.layout.select(keep)
            if batch.constraints is not None:
                batch.constraints.select(keep)
            batch.backend = self.backend = batch.backend.select(batch.layout, keep)
        return True

    def _drop_cancelled(self, batch: _Batch, blk: _Block, cancelled) -> bool:
        """Before a step of the open block: the cancelled rows leave the batch (as at a block's
        end) and the block's state (candidates, schedule, editing, log-probabilities); False
        when none is left."""
        keep = [i for i, r in enumerate(batch.rows) if r not in cancelled]
        if len(keep) == len(batch.rows):
            return True
        none_finished = BlockEvent(batch.rows, [], [], [False] * len(batch.rows), self.nfe)
        if not self._keep_rows(batch, none_finished, cancelled):
            return False
        idx = mx.array(keep)
        blk.gen, blk.cand, blk.schedule = blk.gen[idx], blk.cand[idx], blk.schedule[idx]
        # The steps that a floor of 0 everywhere skips are the survivors' own (one host read).
        blk.floor_max = blk.schedule.max(axis=0).tolist()
        blk.rows_left = [blk.rows_left[i] for i in keep]
        blk.part = None
        if blk.editing is not None:
            blk.editing.select(keep)
        if blk.logprobs is not None:
            blk.logprobs.select(keep)
        return True
