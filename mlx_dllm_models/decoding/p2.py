"""Open-dCoder's "p2" sampling (alg="p2" of MDMGenerationMixin._mdm_sample in
pengzhangzhi/Open-dLLM veomni/models/transformers/qwen2/generation_utils.py), as a commit rule
that also re-masks: sampler "p2".

At step i of `steps` (kappa = (i + 1) / steps), a token x0 is proposed at every position, committed
or not, with its confidence (the probability of x0 under the processed distribution). Of the
positions the canvas decodes (upstream's non-"fix_mask" ones: everything but the prompt), the
int(n * (1 - kappa)) least confident (n: how many there are) become masks, committed tokens among
them; every other mask takes its x0. A committed position that is not re-masked keeps its token,
not x0: its fresh proposal only ranks it. At the last step kappa = 1, so nothing is re-masked and
the canvas is full.

Where the engine departs from upstream: the mask token is never proposed (upstream could sample it
and leave a mask in place); ties in confidence go to the lower position (upstream's
torch.argsort(confidence) does not promise an order among ties).
"""

import mlx.core as mx

from .rule import CommitRule
from .rules import quota_commit


def p2_commit(stats, cand, ctx):
    """(commit, reopen): the masks that take their proposal, and the committed positions that
    become masks again. `ctx.generated` are the positions the rows decode (the others are upstream's
    fixed prompt, confidence +inf)."""
    gen = ctx.generated
    keep = (ctx.step + 1) / ctx.steps
    # num_positions.float() * (1 - kappa_t), truncated: float32 as upstream's tensor product.
    n = gen.sum(axis=1).astype(mx.float32)
    k = (n * mx.array(1 - keep, dtype=mx.float32)).astype(mx.int32)
    # The k least confident decoded positions (quota_commit takes the k highest scores).
    remask = quota_commit(-stats.softmax_confidence, gen, k)
    return cand & ~remask, remask & ~cand


# The rule returns (commit, reopen) instead of a commit mask: the engine writes the mask id back at
# `reopen` (engine.masked). Its steps are all run (the quota floor is not what it commits).
# Confidences ranked as upstream's torch.softmax computes them (decoding.stats.TokenStats).
p2_commit = CommitRule(p2_commit, reopens=True, stats_extras=("softmax_confidence",))
