"""Masked block decoding, the engine's main loop, with its layout and its reference backend (full
recompute). The loop owns state; rules (decoding/) are pure; families differ only through their
DiffusionSpec and the backend the registry picks for their attention layout and `cache` setting.

Masked block decoding (LLaDA, LLaDA-MoE, Dream, and the block-causal families through their
backend): the generated region starts as mask tokens and is decoded block by block; each step
proposes a token for every mask of the current block and a commit rule, with a per-step quota floor
from the schedule, commits some of them. The floor sums to the block's mask count over `steps`, so a
block always completes within its step budget and no mask ever reaches the output. Families that
declare `editing_threshold` (LLaDA2.1) also rewrite committed tokens of the open block, during its
steps and for up to `max_post_steps` forwards after its last mask (token editing).
"""

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx

from ..cache import Positions
from ..decoding import (
    block_ranges,
    entropy_commit,
    factor_commit,
    quota_commit,
    threshold_commit,
    token_stats,
    transfer_schedule,
)
from ..decoding.block import sequential_commit, token_edits
from ..decoding.dream import dream_commit
from ..masks import block_causal_mask, padding_mask
from ..spec import BLOCK_CAUSAL
from .base import StepEvent, block_event, replaced


@dataclass
class StepContext:
    """What a commit rule may read besides the statistics and the candidates."""

    step: int  # 0-based denoising step within the block
    steps: int  # the block's step budget
    floor: mx.array  # (B,) per-row quota of this step from the schedule; rules union it in
    key: Optional[mx.array]  # PRNG key for rules that draw (None at temperature 0 unless needed)
    settings: dict
    spec: object


# A commit rule as the engine calls it: (stats, candidates, ctx) -> (B, L) bool. The schedule's
# floor is what guarantees that a block completes within its steps; every rule unions it in.
# Optional attributes of a rule (a family's own sampler, e.g. Dream's, sets them):
#   schedule(masks (B,), steps, settings) -> (B, steps) int32 floors whose rows sum to `masks`
#     (default: transfer_schedule);
#   exact_floor(settings) -> bool: the rule commits exactly the floor, so a step whose floor is 0
#     in every row is skipped without a forward;
#   stats_extras: optional token statistics the rule reads (decoding.stats.TokenStats).
CommitRule = Callable[..., mx.array]


def _quota(stats, cand, ctx):
    return quota_commit(stats.confidence, cand, ctx.floor)


_quota.exact_floor = lambda settings: True


def _threshold(stats, cand, ctx):
    thr, strict = ctx.settings["threshold"], ctx.spec.strict_threshold
    hit = threshold_commit(stats.confidence, cand, thr, strict=strict)
    return hit | quota_commit(stats.confidence, cand, ctx.floor)


def _factor(stats, cand, ctx):
    hit = factor_commit(stats.confidence, cand, ctx.settings["factor"])
    return hit | quota_commit(stats.confidence, cand, ctx.floor)


def _entropy(stats, cand, ctx):
    hit = entropy_commit(stats.entropy, cand, ctx.settings["entropy_bound"])
    return hit | quota_commit(-stats.entropy, cand, ctx.floor)


COMMIT_RULES: Dict[str, CommitRule] = {
    "quota": _quota,
    "threshold": _threshold,
    "factor": _factor,
    "entropy": _entropy,
    "dream": dream_commit,  # Dream's diffusion_generate; the `alg` setting picks the algorithm
    "sequential": sequential_commit,  # SDAR: the leftmost masks, per the schedule
}

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


class Layout:
    """Where each row's prompt and canvas sit in the (B, W) token array.

    Rows are left-padded; a row's positions count its real tokens only (column - pad). For
    bidirectional families every canvas starts at the same column. For block-causal families,
    whose blocks sit on absolute positions 0, B, 2B, ..., each row's padding is a multiple of the
    block length, so that block boundaries fall on the same columns for every row; canvases then
    start at different columns, and the array extends to the end of the last block, whose
    positions past max_tokens stay masks: the model sees the whole block it was trained on, and
    they are never committed nor returned.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        n_gen: int,
        block_length: int,
        aligned: bool,
        mask_id: int,
        pad_id: int = 0,
    ):
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        if aligned:
            self.pads = [block_length * -(-(longest - n) // block_length) for n in lengths]
        else:
            self.pads = [longest - n for n in lengths]
        self.starts = [p + n for p, n in zip(self.pads, lengths)]
        self.n_gen = n_gen
        width = max(self.starts) + n_gen
        if aligned:
            width = block_length * -(-width // block_length)
        self.width = width
        self.aligned = aligned
        self.block_length = block_length
        rows = [
            [pad_id] * pad + list(p) + [mask_id] * (width - pad - len(p))
            for pad, p in zip(self.pads, prompts)
        ]
        self.tokens = mx.array(rows, dtype=mx.int32)
        cols = mx.arange(width)[None, :]
        starts = mx.array(self.starts)[:, None]
        self.generated = (cols >= starts) & (cols < starts + n_gen)  # (B, W) canvas columns

    def blocks(self):
        first = min(self.starts)
        return block_ranges(
            first, max(self.starts) + self.n_gen - first, self.block_length, aligned=self.aligned
        )

    def select(self, idx: List[int]):
        return replaced(
            self,
            pads=[self.pads[i] for i in idx],
            starts=[self.starts[i] for i in idx],
            generated=self.generated[mx.array(idx)],
        )


class FullRecompute:
    """Every step runs the model over the whole sequence (prompt + canvas). The exact mode for
    bidirectional models, whose every position attends to every other, and the reference mode of
    block-causal ones (under their block-causal mask). Left-padded rows get a padding mask and
    per-row positions; the LM head only runs over the block's rows."""

    def __init__(self, model, spec, layout: Layout, settings: dict):
        self.model = model
        self.shift = spec.logit_shift
        self.nfe = 0
        width = layout.width
        if spec.attention == BLOCK_CAUSAL:
            self.mask = block_causal_mask(
                width,
                settings["block_length"],
                left_padding=layout.pads if any(layout.pads) else None,
            )
        else:
            self.mask = padding_mask(layout.pads, width)
        self.cache = Positions.for_left_padding(layout.pads, len(model.layers))
        self.spec, self.settings = spec, settings

    def prefill(self, x):
        pass

    def begin_block(self, x, start, stop):
        return x

    def block_logits(self, x, start, stop):
        self.nfe += 1
        span = (start - self.shift, stop - self.shift)
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

    def __init__(self, model, settings: dict, eos_token_ids: Sequence[int], backend):
        self.model = model
        self.spec = model.diffusion_spec
        self.s = settings
        self.eos = set(int(e) for e in eos_token_ids)
        self.backend_cls = backend
        self.backend = None
        rule = COMMIT_RULES.get(settings["sampler"])
        if rule is None:
            raise ValueError(f"sampler {settings['sampler']!r} has no commit rule in the engine")
        self.rule = rule
        self.schedule = getattr(rule, "schedule", None) or (
            lambda m, steps, _: transfer_schedule(m, steps)
        )
        self.exact_floor = bool(getattr(rule, "exact_floor", lambda _: False)(settings))
        _warn_untrained_block_length(self.spec, settings)

    @property
    def nfe(self) -> int:
        return self.backend.nfe if self.backend is not None else 0

    def run(self, prompts: Sequence[Sequence[int]]) -> Iterator[object]:
        s, spec = self.s, self.spec
        mask_id = spec.mask_token_id
        layout = Layout(
            prompts, s["max_tokens"], s["block_length"], spec.attention == BLOCK_CAUSAL, mask_id
        )
        x = layout.tokens
        rows = list(range(len(prompts)))
        backend = self.backend = self.backend_cls(self.model, spec, layout, s)
        backend.prefill(x)
        key = mx.random.key(s["seed"])
        greedy = s["temperature"] == 0
        first = min(layout.starts)
        # Token editing (LLaDA2.1 T2T), for families that declare its settings: committed,
        # generated positions of the open block are rewritten when the model proposes another
        # token above editing_threshold, during the block's steps and then for up to
        # max_post_steps more forwards once it has no masks left; a row stops at a step that
        # edits nothing.
        edit_threshold = s.get("editing_threshold")
        editing = edit_threshold is not None
        max_post = (s.get("max_post_steps") or 0) if editing else 0
        for start, stop in layout.blocks():
            x = backend.begin_block(x, start, stop)
            gen = layout.generated[:, start:stop]
            cand = (x[:, start:stop] == mask_id) & gen
            if spec.quota_base == "masks":
                base = cand.sum(axis=1)
            else:
                base = mx.full((x.shape[0],), s["block_length"], mx.int32)
            schedule = self.schedule(base, s["steps"], s)
            no_floor = mx.zeros((x.shape[0],), mx.int32)
            active = cand.any(axis=1)  # rows still iterating on this block
            post = no_floor
            for step in range(s["steps"] + max_post):
                masked = cand.any(axis=1)
                if editing:
                    post = post + (active & ~masked)
                    active = active & (post <= max_post)
                else:
                    active = masked
                if not active.any().item():
                    break
                floor = schedule[:, step] if step < s["steps"] else no_floor
                if self.exact_floor and not editing and floor.max().item() == 0:
                    continue  # nothing to commit: the reference's forward would change nothing
                logits = backend.block_logits(x, start, stop)
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
                )
                ctx = StepContext(step, s["steps"], floor, k_rule, s, spec)
                commit = self.rule(stats, cand, ctx)
                current = x[:, start:stop]
                if editing:
                    editable = gen & (current != mask_id) & active[:, None]
                    edits = token_edits(
                        stats, current, editable, edit_threshold, spec.strict_threshold
                    )
                    commit = commit | edits
                    active = active & (masked | edits.any(axis=1))
                block = mx.where(commit, stats.x0.astype(mx.int32), current)
                x[:, start:stop] = block
                cand = (block == mask_id) & gen
                yield StepEvent(rows, x[:, first:], (start - first, stop - first), self.nfe)
            assert not cand.any().item(), "a block left masks after its step budget"
            backend.end_block(x, start, stop)
            new = [
                [t for t, keep in zip(toks, g) if keep]
                for toks, g in zip(x[:, start:stop].tolist(), gen.tolist())
            ]
            at_limit = [stop >= s0 + layout.n_gen for s0 in layout.starts]
            event = block_event(rows, new, at_limit, self.eos, self.nfe)
            yield event
            keep = [i for i, f in enumerate(event.finished) if not f]
            if not keep:
                return
            if len(keep) < len(rows):
                # Rows are independent: drop finished ones from the batch instead of computing them.
                x = x[mx.array(keep)]
                rows = [rows[i] for i in keep]
                layout = layout.select(keep)
                backend = self.backend = backend.select(layout, keep)
