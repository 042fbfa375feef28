"""The samplers of masked block decoding: the `sampler` setting's names -> commit rules.

A family lists the samplers it honours in its DiffusionSpec (`samplers`); the masked block engine
(engine.masked) looks the setting up with commit_rule: first the rules the family declares as its
own (`DiffusionSpec.commit_rules`, from its model file's SAMPLERS: Dream's, Dimple's, RND1's,
dllm's block sampler), then COMMIT_RULES, the shared ones, next to the rules they name. Adding a
shared sampler is a rule and a row here (and the families' `samplers`); every sampler a family
lists must have a rule. DiffusionGemma's samplers are not here: its canvas loop implements its own
two (engine.canvas.CanvasDecoder).

Each rule is a decoding.rule.CommitRule: the function and what it declares (its schedule,
exact_floor, reopens, fills_after_eos, stats_extras, draws), with the defaults there; a family's own
sampler (e.g. Dream's) declares them where its rule is written.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx

from ..settings_fields import ResolvedSettings
from .block import entropy_bounded_commit, sequential_commit
from .d3llm import d3llm_commit
from .dllm import dllm_commit
from .lavida import lavida_commit
from .llada import random_commit
from .p2 import p2_commit
from .rule import CommitRule, always
from .rules import entropy_commit, factor_commit, quota_commit, threshold_commit
from .sub_block import sub_block_commit


@dataclass
class StepContext:
    """What a commit rule may read besides the statistics and the candidates."""

    step: int  # 0-based denoising step within the block
    steps: int  # the block's step budget
    floor: mx.array  # (B,) per-row quota of this step from the schedule; rules union it in
    key: Optional[mx.array]  # PRNG key for rules that draw (None at temperature 0 unless needed)
    settings: ResolvedSettings
    spec: object
    # (B, L) the window's positions the rows decode (the d3llm rule counts its blocks on them).
    generated: Optional[mx.array] = None


# The plain samplers: rules.py's rules, each with the step's quota floor unioned in.


def _quota(stats, cand, ctx):
    return quota_commit(stats.confidence, cand, ctx.floor)


def _threshold(stats, cand, ctx):
    thr, strict = ctx.settings.threshold, ctx.spec.strict_threshold
    hit = threshold_commit(stats.confidence, cand, thr, strict=strict)
    return hit | quota_commit(stats.confidence, cand, ctx.floor)


def _factor(stats, cand, ctx):
    hit = factor_commit(stats.confidence, cand, ctx.settings.factor)
    return hit | quota_commit(stats.confidence, cand, ctx.floor)


def _entropy(stats, cand, ctx):
    hit = entropy_commit(stats.entropy, cand, ctx.settings.entropy_bound)
    return hit | quota_commit(-stats.entropy, cand, ctx.floor)


COMMIT_RULES: Dict[str, CommitRule] = {
    "quota": CommitRule(_quota, exact_floor=always),
    "threshold": CommitRule(_threshold),
    "factor": CommitRule(_factor),
    "entropy": CommitRule(_entropy),
    "sequential": sequential_commit,  # SDAR: the leftmost masks, per the schedule
    "entropy_bounded": CommitRule(
        entropy_bounded_commit
    ),  # SDAR generate.py's entropy_bounded, eb_threshold
    "random": random_commit,  # LLaDA generate.py's remasking="random"
    "sub_block": CommitRule(
        sub_block_commit
    ),  # Fast-dLLM v2's threshold over sub-blocks, sub_block_length
    "d3llm": d3llm_commit,  # d3LLM's multi-block entropy threshold (LLaDA and Dream)
    "mdlm": dllm_commit,  # dllm's MDLMSampler: low_confidence on its linear-alpha schedule
    "lavida": lavida_commit,  # LaViDa's generate: low_confidence on a noise schedule's quotas
    "p2": p2_commit,  # Open-dCoder's _mdm_sample alg="p2": re-masks the least confident positions
}


def commit_rule(spec, name: str) -> Optional[CommitRule]:
    """The rule of sampler `name` for a family: its own (`spec.commit_rules`), else the shared
    table's; None when neither has one."""
    return spec.commit_rules.get(name) or COMMIT_RULES.get(name)
