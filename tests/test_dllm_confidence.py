"""dllm's samplers (MDLMSampler, BD3LMSampler) rank the masks by torch's F.softmax(logits) at the
proposed token: where several masks are all within 1e-6 of certain, the order it keeps is the one
exp(logit - logsumexp) loses in float32 (a logsumexp near 40 rounds in steps of 4e-6), so the
package ranks them as torch does (issue 43: the published call of an A2D checkpoint)."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlx_dllm_models.decoding.samplers import COMMIT_RULES, StepContext
from mlx_dllm_models.decoding.stats import token_stats
from mlx_dllm_models.models.a2d_qwen3 import SAMPLERS as A2D_SAMPLERS

VOCAB = 8
# 1 - p at the argmax: about 1.3e-6, 9.6e-7 and 2.4e-8, as at an A2D fixture's saturated masks;
# exp(logit - logsumexp) makes all three 1.0.
TOP, GAPS = 40.0, [15.5, 15.8, 19.5]


def _logits():
    rows = []
    for gap in GAPS:
        row = np.full(VOCAB, TOP - gap, np.float32)
        row[3] = TOP
        rows.append(row)
    return np.array([rows], np.float32)  # (1, 3, VOCAB)


@pytest.mark.parametrize("sampler", ["mdlm", "bd3lm"])
def test_saturated_masks_rank_as_torch_softmax_ranks_them(sampler):
    logits = _logits()
    p = torch.softmax(torch.from_numpy(logits), -1).amax(-1)[0]
    want = int(torch.argmax(p))
    assert want == 2 and len(set(p.tolist())) == 3  # torch tells the three apart
    rule = {**COMMIT_RULES, **A2D_SAMPLERS}[sampler]
    stats = token_stats(mx.array(logits), extras=rule.stats_extras)
    ctx = StepContext(0, 4, mx.array([1]), None, {}, None)
    commit = rule(stats, mx.array([[True, True, True]]), ctx)
    assert np.nonzero(np.array(commit)[0])[0].tolist() == [want]
