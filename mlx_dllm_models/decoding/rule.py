"""The commit rule's contract: a rule of masked block decoding and what it declares, as one typed
object (CommitRule), so that the engine reads every capability with its default from here."""

from dataclasses import dataclass
from typing import Callable, Mapping, Tuple

import mlx.core as mx

from ..settings_fields import ResolvedSettings
from .schedule import transfer_schedule


def default_schedule(masks, steps, settings):
    """transfer_schedule over at most as many steps as the most masks a row has: its first columns
    are those of the (B, steps) schedule, whose later columns are all 0 (one token a step, then
    nothing), so steps=10**9 costs what steps=masks does."""
    most = max(int(masks.max().item()), 1)
    return transfer_schedule(masks, min(steps, most))


def never(settings: ResolvedSettings) -> bool:
    return False


def always(settings: ResolvedSettings) -> bool:
    return True


@dataclass(frozen=True)
class CommitRule:
    """A commit rule as the engine calls it: `rule(stats, candidates, ctx)` -> (B, L) bool (with
    `reopens`: a (commit, reopen) pair), where ctx is decoding.samplers.StepContext. The
    schedule's floor is what guarantees that a block completes within its steps; every rule
    unions it in."""

    commit: Callable[..., mx.array]
    # (masks (B,), steps, settings) -> (B, K) int32 floors of the first K <= steps steps, whose
    # rows sum to `masks`; every later step's floor is 0, so that `steps` above what a block needs
    # allocates nothing.
    schedule: Callable[..., mx.array] = default_schedule
    # (settings) -> whether the rule commits exactly the floor: a step whose floor is 0 in every
    # row is then skipped without a forward.
    exact_floor: Callable[[Mapping], bool] = never
    # The rule returns (commit, reopen): the engine writes the mask id back at `reopen`
    # (Open-dCoder's p2); such a rule refuses grammar constraints.
    reopens: bool = False
    # (settings) -> whether, after each commit, every generated position after a row's first EOS
    # becomes that EOS (d3llm.fill_after_eos: d3LLM's early stop).
    fills_after_eos: Callable[[Mapping], bool] = never
    # Optional token statistics the rule reads (decoding.stats.TokenStats).
    stats_extras: Tuple[str, ...] = ()
    # (settings) -> whether the rule draws from the row's seeded stream under these settings
    # (beyond the token sampling of temperature > 0), so that the seed changes its commits: a
    # request that names no seed then gets a fresh one (engine.registry.draws_noise).
    draws: Callable[[Mapping], bool] = never

    def __call__(self, stats, cand, ctx):
        return self.commit(stats, cand, ctx)
