"""Masked block decoding, the engine's main loop, with its layout and its reference backend (full
recompute). The loop owns state; rules (decoding/) are pure; families differ only through their
DiffusionSpec and the backend the registry picks for their attention layout and `cache` setting.

Masked block decoding (LLaDA, LLaDA-MoE, Dream, and the block-causal families through their
backend): the generated region starts as mask tokens and is decoded block by block; each step
proposes a token for every mask of the current block and a commit rule, with a per-step quota floor
from the schedule, commits some of them. The floor sums to the block's mask count over `steps`, so a
block always completes within its step budget and no mask ever reaches the output. Families that
declare `editing_threshold` (LLaDA2.1) also rewrite committed tokens of the open block, during its
steps and for up to `max_post_steps` forwards after its last mask (token editing); a row's editing
stops early at a step that edits nothing, or that brings its maskless block back to a state it held
before (edits that flip-flop would otherwise cycle until max_post_steps).

Work is bounded by the block, not by the settings: a schedule holds only the steps that can commit
(`steps` above a block's mask count adds no column and no forward), and the first forward's logits
are checked to be finite (corrupt weights are an error naming the checkpoint, not garbage output).
"""

import logging
from typing import AbstractSet, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from ..cache import Positions
from ..decoding import block_ranges, token_stats
from ..decoding.block import token_edits
from ..decoding.llada import (
    confidence_suppressed_ids,
    guided_logits,
    suppress_logits,
    unconditional_tokens,
)
from ..decoding.samplers import COMMIT_RULES, StepContext, default_schedule
from ..masks import block_causal_mask, padding_mask
from ..settings import SettingsError
from ..spec import BLOCK_CAUSAL
from .base import StepEvent, block_event, check_finite, replaced


def _revisited(seen, block, cand) -> mx.array:
    """(B,) bool: rows whose block, with no masks left, is in a state they held before (recorded
    in `seen`, one set of states per row). LLaDA2.1's editing would cycle from there."""
    out = []
    for states, tokens, masked in zip(seen, block.tolist(), cand.any(axis=1).tolist()):
        state = tuple(tokens)
        out.append(not masked and state in states)
        if not masked:
            states.add(state)
    return mx.array(out)


logger = logging.getLogger(__name__)
_WARNED_BLOCK_LENGTHS = set()


def _warn_untrained_block_length(spec, settings):
    """Block-causal checkpoints are trained with one block size; another one runs, but quality
    depends on it. Said once per process for each (family, trained, chosen) size."""
    trained, chosen = spec.trained_block_length, settings["block_length"]
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


def _settled_by_eos(block, cand, gen, eos) -> mx.array:
    """(B,) rows whose block holds an EOS among its decoded positions with no mask before it:
    nothing after that EOS is ever returned, so the row's block is done (Nemotron's generate)."""
    is_eos = mx.zeros(block.shape, dtype=mx.bool_)
    for e in eos:
        is_eos = is_eos | (block == e)
    is_eos = is_eos & gen & ~cand
    seen = mx.cumsum(is_eos.astype(mx.int32), axis=-1) > 0  # at or after the first EOS
    return is_eos.any(axis=-1) & ~(cand & ~seen).any(axis=-1)


class Layout:
    """Where each row's prompt and canvas sit in the (B, W) token array.

    Rows are left-padded; a row's positions count its real tokens only (column - pad). For
    bidirectional families every canvas starts at the same column. For block-causal families,
    whose blocks sit on absolute positions 0, B, 2B, ..., each row's padding is a multiple of the
    block length, so that block boundaries fall on the same columns for every row; canvases then
    start at different columns, and the array extends to the end of the last block.

    `generated` marks the columns a row returns (its max_tokens positions); `decoded` the columns
    it decodes. They differ for block-causal families only: there a row decodes every position of
    its last block, past max_tokens included, and the output is cut afterwards, as SDAR's
    block_diffusion_generate and LLaDA2's generate do (their last block is a full block of masks,
    and its quota schedule and threshold steps count all of them), so tokens match the references
    whatever max_tokens is.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        n_gen: Union[int, Sequence[int]],
        block_length: int,
        aligned: bool,
        mask_id: int,
        pad_id: int = 0,
        suffix: Sequence[int] = (),
    ):
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        if aligned:
            self.pads = [block_length * -(-(longest - n) // block_length) for n in lengths]
        else:
            self.pads = [longest - n for n in lengths]
        self.starts = [p + n for p, n in zip(self.pads, lengths)]
        # Each row's budget of new tokens: one for all, or one per row (the server's rows that
        # joined a batch with part of their tokens already committed, see server.py).
        n_gens = [n_gen] * len(prompts) if isinstance(n_gen, int) else [int(n) for n in n_gen]
        self.n_gens = n_gens
        self.n_gen = max(n_gens)
        # Infilling (bidirectional families only): each row's canvas is followed by `suffix`.
        suffix = list(suffix)
        self.suffix_length = len(suffix)
        width = max(s + n for s, n in zip(self.starts, n_gens)) + len(suffix)
        if aligned:
            width = block_length * -(-width // block_length)
        self.width = width
        self.aligned = aligned
        self.block_length = block_length
        rows = [
            [pad_id] * pad
            + list(p)
            + [mask_id] * n
            + suffix
            + [mask_id] * (width - pad - len(p) - n - len(suffix))
            for pad, p, n in zip(self.pads, prompts, n_gens)
        ]
        self.tokens = mx.array(rows, dtype=mx.int32)
        cols = mx.arange(width)[None, :]
        starts = mx.array(self.starts)[:, None]
        self.ends = [s + n for s, n in zip(self.starts, n_gens)]  # past each row's last column
        self.generated = (cols >= starts) & (cols < mx.array(self.ends)[:, None])  # (B, W)
        if aligned:
            ends = mx.array([block_length * -(-e // block_length) for e in self.ends])
            self.decoded = (cols >= starts) & (cols < ends[:, None])
        else:
            self.decoded = self.generated
        real = cols >= mx.array(self.pads)[:, None]
        # The tokens a row was given (prompt, suffix; not padding): classifier-free guidance's
        # unconditional row masks them.
        self.given = real & (self.tokens != mask_id)
        # Masks inside a prompt (infilling): decoded too, as LLaDA's and Dream's references do.
        self.infill = real & (self.tokens == mask_id) & (cols < starts)
        self.has_infill = bool(self.infill.any().item())

    def window_start(self, x, mask_id: int, start: int) -> int:
        """The first column of a block's candidate window: `start`, or the first mask still left
        inside a prompt (every mask before a block's end is a candidate, as in LLaDA's
        generate.py; Dream decodes its whole canvas as one block)."""
        if not self.has_infill:
            return start
        left = self.infill[:, :start] & (x[:, :start] == mask_id)
        if not left.any().item():
            return start
        return int(mx.argmax(left.any(axis=0)).item())

    def blocks(self):
        first = min(self.starts)
        # Aligned: up to the end of the last block, whose positions past max_tokens are decoded.
        end = self.width if self.aligned else max(self.ends)
        return block_ranges(first, end - first, self.block_length, aligned=self.aligned)

    def select(self, idx: List[int]):
        return replaced(
            self,
            pads=[self.pads[i] for i in idx],
            starts=[self.starts[i] for i in idx],
            n_gens=[self.n_gens[i] for i in idx],
            ends=[self.ends[i] for i in idx],
            generated=self.generated[mx.array(idx)],
            decoded=self.decoded[mx.array(idx)],
            given=self.given[mx.array(idx)],
            infill=self.infill[mx.array(idx)],
        )


class FullRecompute:
    """Every step runs the model over the whole sequence (prompt + canvas). The exact mode for
    bidirectional models, whose every position attends to every other, and the reference mode of
    block-causal ones (under their block-causal mask). Left-padded rows get a padding mask and
    per-row positions; the LM head only runs over the block's rows."""

    # It runs LLaDA's classifier-free guidance (cfg_scale): unconditional rows in the same forward.
    guidance = True
    # Its `select(layout, rows)` is a view the engine may run a step's forward on when only those
    # rows have masks left in the block (every forward recomputes from the tokens: nothing to keep).
    row_steps = True

    def __init__(self, model, spec, layout: Layout, settings: dict):
        self.model = model
        self.shift = spec.logit_shift
        self.nfe = 0
        width = layout.width
        ends = None
        if spec.attention == BLOCK_CAUSAL:
            self.mask = block_causal_mask(
                width,
                settings["block_length"],
                left_padding=layout.pads if any(layout.pads) else None,
            )
        else:
            # Rows with different budgets (server.py): a row never attends past its own last
            # column, as alone it has no column there (the width is the longest row's, and
            # stays so after that row leaves).
            # An infilling suffix follows each row's canvas and is attended.
            ends = [e + layout.suffix_length for e in layout.ends]
            ends = ends if min(ends) < width else None
            self.mask = padding_mask(layout.pads, width, ends=ends)
        self.cache = Positions.for_left_padding(layout.pads, len(model.layers))
        self.spec, self.settings = spec, settings
        self.cfg_scale = settings.get("cfg_scale") or 0.0
        if self.cfg_scale:
            # Classifier-free guidance (LLaDA): the unconditional rows follow the conditional ones
            # in the same forward, with the same padding.
            pads = list(layout.pads) * 2
            self.mask = padding_mask(pads, width, ends=None if ends is None else ends * 2)
            self.cache = Positions.for_left_padding(pads, len(model.layers))
            self.given = layout.given

    def prefill(self, x):
        pass

    def begin_block(self, x, start, stop):
        return x

    def block_logits(self, x, start, stop):
        self.nfe += 1
        span = (start - self.shift, stop - self.shift)
        if self.cfg_scale:
            un = unconditional_tokens(x, self.given, self.spec.mask_token_id)
            both = self.model(
                mx.concatenate([x, un]), cache=self.cache, mask=self.mask, head_span=span
            )
            n = x.shape[0]
            return guided_logits(both[:n], both[n:], self.cfg_scale)
        return self.model(x, cache=self.cache, mask=self.mask, head_span=span)

    def end_block(self, x, start, stop):
        pass

    def select(self, layout: Layout, idx: List[int]):
        fresh = type(self)(self.model, self.spec, layout, self.settings)
        fresh.nfe = self.nfe
        return fresh


class MaskedBlockDecoder:
    """Masked block decoding for a batch of prompts (B >= 1). The loop is the same for every
    family; what differs (how logits of a block are computed, caches, block seeding) lives in the
    backend, a class that engine.registry picks from the spec's attention layout and the `cache`
    setting."""

    def __init__(
        self,
        model,
        settings: dict,
        eos_token_ids: Sequence[int],
        backend,
        eot_token_id: Optional[int] = None,
        suffix: Sequence[int] = (),
    ):
        self.model = model
        self.spec = model.diffusion_spec
        self.s = settings
        self.eos = set(int(e) for e in eos_token_ids)
        self.suffix = list(suffix)  # infilling: the tokens after every row's canvas
        if settings.get("cfg_scale") and not getattr(backend, "guidance", False):
            raise SettingsError(
                f"cfg_scale is not supported with cache={settings.get('cache')!r}: guidance runs "
                "the unconditional rows beside the conditional ones in each forward, which that "
                "backend does not; pass cache='none' or drop cfg_scale"
            )
        # LLaDA generate.py's Appendix B.4 options: logits_eos_inf touches the checkpoint's EOS
        # (config.json's eos_token_id, upstream's 126081), confidence_eos_eot_inf its end of turn
        # (upstream's 126348, <|eot_id|>), resolved from the tokenizer by the caller.
        self.logits_suppressed = self.spec.eos_token_ids if settings.get("logits_eos_inf") else ()
        self.confidence_suppressed = ()
        if settings.get("confidence_eos_eot_inf"):
            if eot_token_id is None:
                raise ValueError("confidence_eos_eot_inf needs the end-of-turn token id")
            self.confidence_suppressed = confidence_suppressed_ids(
                self.spec.eos_token_ids, eot_token_id, settings["temperature"]
            )
        self.backend_cls = backend
        self.backend = None
        self.tokens = None  # the last run's (B, W) tokens, for kv_prefix
        rule = COMMIT_RULES.get(settings["sampler"])
        if rule is None:
            raise ValueError(f"sampler {settings['sampler']!r} has no commit rule in the engine")
        self.rule = rule
        self.schedule = getattr(rule, "schedule", None) or default_schedule
        self.exact_floor = bool(getattr(rule, "exact_floor", lambda _: False)(settings))
        _warn_untrained_block_length(self.spec, settings)

    @property
    def nfe(self) -> int:
        return self.backend.nfe if self.backend is not None else 0

    def kv_prefix(self):
        """The K/V the last run left final, as a cache.PriorKV for `run(prompts, prior=...)` of a
        prompt that continues its tokens (a chat's next turn); None when the backend keeps no K/V
        (full recompute: bidirectional families recompute everything every step anyway) or the
        run had more than one row left."""
        get = getattr(self.backend, "kv_prefix", None)
        if get is None or self.tokens is None or self.tokens.shape[0] != 1:
            return None
        return get(self.tokens)

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        budgets: Optional[Sequence[int]] = None,
        cancelled: AbstractSet[int] = frozenset(),
        prior=None,
    ) -> Iterator[object]:
        """Decode `prompts` (left-padded into one batch), yielding StepEvents and BlockEvents.
        `budgets`: each row's max_tokens (default: the max_tokens setting for every row).
        `cancelled`: a set the caller may grow while the run goes on; a row in it leaves the batch
        at the next block boundary, as a finished row does (the server's disconnected clients).
        `prior`: a cache.PriorKV from an earlier run (see `kv_prefix`) whose K/V the prefill reuses
        over the prefix the (single) prompt shares with it; the tokens are those of a run without
        it. Backends with a KV cache only (block-causal and causal-prefix families)."""
        s, spec = self.s, self.spec
        mask_id = spec.mask_token_id
        layout = Layout(
            prompts,
            s["max_tokens"] if budgets is None else budgets,
            s["block_length"],
            spec.attention == BLOCK_CAUSAL,
            mask_id,
            suffix=self.suffix,
        )
        x = layout.tokens
        rows = list(range(len(prompts)))
        backend = self.backend = self.backend_cls(self.model, spec, layout, s)
        self.tokens = None
        if prior is None:
            backend.prefill(x)
        else:
            resume = getattr(backend, "resume", None)
            if resume is None or len(prompts) != 1:
                raise SettingsError(
                    f"{type(backend).__name__} cannot reuse an earlier run's K/V "
                    f"({'it keeps none' if resume is None else 'one prompt at a time'}); "
                    "run without prior"
                )
            resume(x, prior)
        key = mx.random.key(s["seed"])
        greedy = s["temperature"] == 0
        first = min(layout.starts)
        # Token editing (LLaDA2.1 T2T), for families that declare its settings: committed,
        # generated positions of the open block are rewritten when the model proposes another
        # token above editing_threshold, during the block's steps and then for up to
        # max_post_steps more forwards once it has no masks left; a row stops at a step that
        # edits nothing, and at a step that brings its block back to a state it held before,
        # once it has no masks left (edits flip-flopping between tokens: more forwards would
        # only cycle). It keeps that state.
        edit_threshold = s.get("editing_threshold")
        editing = edit_threshold is not None
        max_post = (s.get("max_post_steps") or 0) if editing else 0
        unchecked = True
        for start, stop in layout.blocks():
            x = backend.begin_block(x, start, stop)
            # The candidate window [lo, stop): the block, and masks left inside a prompt. Its
            # quota counts both, so that every mask is filled; LLaDA's generate.py counts only
            # the block's, and would end with as many masks as the prompt held.
            lo = layout.window_start(x, mask_id, start)
            gen = layout.decoded[:, lo:stop] | layout.infill[:, lo:stop]
            cand = (x[:, lo:stop] == mask_id) & gen
            if spec.quota_base == "masks":
                base = cand.sum(axis=1)
            else:
                base = mx.full((x.shape[0],), s["block_length"], mx.int32)
            schedule = self.schedule(base, s["steps"], s)
            no_floor = mx.zeros((x.shape[0],), mx.int32)
            active = cand.any(axis=1)  # rows still iterating on this block
            seen = [set() for _ in rows]  # editing: each row's maskless block states so far
            post = no_floor
            # Host reads stall the device: one per step at most. The block's first read brings
            # which rows have a candidate and the schedule's per-step maxima (a step whose
            # floor is 0 everywhere is skipped without a forward); then, without editing, each
            # step ends with one read of which rows have masks left.
            n = x.shape[0]
            first_read = mx.concatenate(
                [cand.any(axis=1).astype(mx.int32), schedule.max(axis=0).astype(mx.int32)]
            ).tolist()
            rows_left, floor_max = first_read[:n], first_read[n:]
            left = any(rows_left)
            part = None  # (rows, their backend view) while only some rows have masks left
            for step in range(s["steps"] + max_post):
                if self.exact_floor and not editing and step >= len(floor_max):
                    break  # past the schedule's columns every floor is 0: nothing more commits
                if (
                    self.exact_floor
                    and not editing
                    and (step >= len(floor_max) or floor_max[step] == 0)
                ):
                    continue  # nothing to commit: the reference's forward would change nothing
                masked = cand.any(axis=1)
                if editing:
                    post = post + (active & ~masked)
                    active = active & (post <= max_post)
                    if not active.any().item():
                        break
                elif not left:
                    break
                else:
                    active = masked
                floor = schedule[:, step] if step < schedule.shape[1] else no_floor
                # A row whose block has no masks left commits nothing more: once some rows are
                # there, the step's forward runs over the others only (on a CPU a forward costs
                # about its rows; a batch would otherwise wait on its slowest row at full width).
                sub = None
                if not editing and not all(rows_left) and getattr(backend, "row_steps", False):
                    sub = [i for i, r in enumerate(rows_left) if r]
                    if part is None or part[0] != sub:
                        part = (sub, backend.select(layout.select(sub), sub))
                    idx = mx.array(sub)
                    logits = part[1].block_logits(x[idx], lo, stop)
                    backend.nfe += 1
                else:
                    logits = backend.block_logits(x, lo, stop)
                if unchecked:  # corrupt weights show at the first forward (one host sync)
                    check_finite(logits, self.model)
                    unchecked = False
                logits = suppress_logits(logits, self.logits_suppressed)
                key, k_stats, k_rule = mx.random.split(key, 3)
                stats = token_stats(
                    logits,
                    temperature=s["temperature"],
                    top_k=s["top_k"],
                    top_p=s["top_p"],
                    key=None if greedy else k_stats,
                    suppress_ids=(mask_id, *spec.suppressed_token_ids),
                    confidence=spec.confidence,
                    order=spec.sampling_order,
                    extras=getattr(self.rule, "stats_extras", ()),
                    confidence_suppress_ids=self.confidence_suppressed,
                )
                if sub is None:
                    ctx = StepContext(step, s["steps"], floor, k_rule, s, spec)
                    commit, x0 = self.rule(stats, cand, ctx), stats.x0
                else:  # the rows' proposals in place, nothing committed elsewhere
                    ctx = StepContext(step, s["steps"], floor[idx], k_rule, s, spec)
                    commit = mx.zeros(cand.shape, dtype=mx.bool_)
                    commit[idx] = self.rule(stats, cand[idx], ctx)
                    x0 = mx.zeros(cand.shape, dtype=mx.int32)
                    x0[idx] = stats.x0.astype(mx.int32)
                current = x[:, lo:stop]
                if editing:
                    editable = gen & (current != mask_id) & active[:, None]
                    edits = token_edits(
                        stats, current, editable, edit_threshold, spec.strict_threshold
                    )
                    commit = commit | edits
                    active = active & (masked | edits.any(axis=1))
                block = mx.where(commit, x0.astype(mx.int32), current)
                x[:, lo:stop] = block
                cand = (block == mask_id) & gen
                if spec.eos_ends_block and self.eos:
                    cand = cand & ~_settled_by_eos(block, cand, gen, self.eos)[:, None]
                if editing:
                    active = active & ~_revisited(seen, block, cand)
                else:
                    rows_left = cand.any(axis=1).tolist()
                    left = any(rows_left)
                # The view ends at max_tokens: decoded positions past it are never returned.
                view = x[:, first : max(layout.ends)]
                yield StepEvent(rows, view, (start - first, stop - first), self.nfe)
            # One read: each row's returned tokens (-1 past max_tokens), then whether masks are left.
            read = mx.concatenate(
                [
                    mx.where(layout.generated[:, start:stop], x[:, start:stop], -1),
                    cand.any(axis=1, keepdims=True).astype(x.dtype),
                ],
                axis=1,
            ).tolist()
            assert not any(r[-1] for r in read), "a block left masks after its step budget"
            backend.end_block(x, start, stop)
            new = [[t for t in r[:-1] if t >= 0] for r in read]
            at_limit = [stop >= end for end in layout.ends]
            event = block_event(rows, new, at_limit, self.eos, self.nfe)
            if layout.has_infill and lo < start:
                # The masks of a prompt are all filled with the first block (its quota counted
                # them): a row's returned span starts at its prompt's first mask.
                for i, toks in enumerate(event.tokens):
                    where = layout.infill[i].tolist()
                    if True in where:
                        toks[:0] = x[i, where.index(True) : layout.starts[i]].tolist()
            self.tokens = x
            yield event
            keep = [i for i, f in enumerate(event.finished) if not f and rows[i] not in cancelled]
            if not keep:
                return
            if len(keep) < len(rows):
                # Rows are independent: drop finished ones from the batch instead of computing them.
                x = x[mx.array(keep)]
                rows = [rows[i] for i in keep]
                layout = layout.select(keep)
                backend = self.backend = backend.select(layout, keep)
