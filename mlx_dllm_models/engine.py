"""The decoding loops. The engine owns state; rules (decoding/) are pure; families differ only
through their DiffusionSpec.

Masked block decoding (LLaDA, LLaDA-MoE, Dream, and the block-causal families through their
backend): the generated region starts as mask tokens and is decoded block by block; each step
proposes a token for every mask of the current block and a commit rule, with a per-step quota floor
from the schedule, commits some of them. The floor sums to the block's mask count over `steps`, so a
block always completes within its step budget and no mask ever reaches the output.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx

from .cache import Positions
from .decoding import (
    block_ranges,
    entropy_commit,
    factor_commit,
    quota_commit,
    threshold_commit,
    token_stats,
    transfer_schedule,
)
from .masks import padding_mask


@dataclass
class StepEvent:
    """One denoising step: the current generated region of every active row (masks included)."""

    rows: List[int]
    generated: mx.array  # (B, max_tokens), lazy: only evaluated by a consumer that looks
    block: tuple
    nfe: int

    @property
    def canvas(self) -> List[List[int]]:
        return self.generated.tolist()


@dataclass
class BlockEvent:
    """A block was committed. `tokens[i]` are row `rows[i]`'s new tokens (cut before its EOS);
    `eos[i]` says the row met an EOS in this block; `finished[i]` that the row is done (EOS, or
    max_tokens reached)."""

    rows: List[int]
    tokens: List[List[int]]
    eos: List[bool]
    finished: List[bool]
    nfe: int


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
CommitRule = Callable[..., mx.array]


def _quota(stats, cand, ctx):
    return quota_commit(stats.confidence, cand, ctx.floor)


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
}


class FullRecompute:
    """Every step runs the model over the whole sequence (prompt + canvas). The exact mode for
    bidirectional models, whose every position attends to every other. Left-padded rows get a
    padding mask and per-row positions; the LM head only runs over the block's rows."""

    def __init__(self, model, spec, pads: Sequence[int], length: int):
        self.model = model
        self.shift = spec.logit_shift
        self.mask = padding_mask(pads, length)
        self.cache = Positions.for_left_padding(pads, len(model.layers))

    def block_logits(self, x, start, stop):
        rows = (start - self.shift, stop - self.shift)
        return self.model(x, cache=self.cache, mask=self.mask, rows=rows)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int):
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    rows = [[pad_id] * n + list(p) for n, p in zip(pads, prompts)]
    return mx.array(rows, dtype=mx.int32), pads


class MaskedBlockDecoder:
    """Masked block decoding for a batch of prompts (B >= 1)."""

    def __init__(self, model, settings: dict, eos_token_ids: Sequence[int], backend=FullRecompute):
        self.model = model
        self.spec = model.diffusion_spec
        self.s = settings
        self.eos = set(int(e) for e in eos_token_ids)
        self.backend_cls = backend
        self.nfe = 0
        rule = COMMIT_RULES.get(settings["sampler"])
        if rule is None:
            raise ValueError(f"sampler {settings['sampler']!r} has no commit rule in the engine")
        self.rule = rule

    def _forward(self, backend, x, start, stop):
        self.nfe += 1
        return backend.block_logits(x, start, stop)

    def run(self, prompts: Sequence[Sequence[int]]) -> Iterator[object]:
        s, spec = self.s, self.spec
        mask_id = spec.mask_token_id
        n_gen = s["max_tokens"]
        prompt_arr, pads = left_pad(prompts, pad_id=mask_id)
        P = prompt_arr.shape[1]
        x = mx.concatenate([prompt_arr, mx.full((len(prompts), n_gen), mask_id, mx.int32)], axis=1)
        rows = list(range(len(prompts)))
        backend = self.backend_cls(self.model, spec, pads, x.shape[1])
        key = mx.random.key(s["seed"])
        greedy = s["temperature"] == 0
        for start, stop in block_ranges(P, n_gen, s["block_length"]):
            cand = x[:, start:stop] == mask_id
            base = cand.sum(axis=1) if spec.quota_base == "masks" else mx.full(
                (x.shape[0],), stop - start, mx.int32
            )
            schedule = transfer_schedule(base, s["steps"])
            for step in range(s["steps"]):
                if not cand.any().item():
                    break
                floor = schedule[:, step]
                if s["sampler"] == "quota" and floor.max().item() == 0:
                    continue  # nothing to commit: the reference's forward would change nothing
                logits = self._forward(backend, x, start, stop)
                key, k_stats, k_rule = mx.random.split(key, 3)
                stats = token_stats(
                    logits,
                    temperature=s["temperature"],
                    top_k=s["top_k"],
                    top_p=s["top_p"],
                    key=None if greedy else k_stats,
                    suppress_ids=(mask_id,),
                    confidence=spec.confidence,
                )
                ctx = StepContext(step, s["steps"], floor, k_rule, s, spec)
                commit = self.rule(stats, cand, ctx)
                block = mx.where(commit, stats.x0.astype(mx.int32), x[:, start:stop])
                x[:, start:stop] = block
                cand = block == mask_id
                yield StepEvent(rows, x[:, P:], (start - P, stop - P), self.nfe)
            assert not cand.any().item(), "a block left masks after its step budget"
            new = x[:, start:stop].tolist()
            hit, emitted = [], []
            for toks in new:
                cut = next((i for i, t in enumerate(toks) if t in self.eos), None)
                hit.append(cut is not None)
                emitted.append(toks if cut is None else toks[:cut])
            last = stop == P + n_gen
            finished = [h or last for h in hit]
            yield BlockEvent(list(rows), emitted, hit, finished, self.nfe)
            keep = [i for i, f in enumerate(finished) if not f]
            if not keep:
                return
            if len(keep) < len(rows):
                # Rows are independent: drop finished ones from the batch instead of computing them.
                idx = mx.array(keep)
                x = x[idx]
                rows = [rows[i] for i in keep]
                pads = [pads[i] for i in keep]
                backend = self.backend_cls(self.model, spec, pads, x.shape[1])
