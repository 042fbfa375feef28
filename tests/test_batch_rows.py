"""A batch step runs its forward over the rows that still have masks in the block (issue #14 §4).

With a threshold sampler, rows finish a block after different numbers of steps; the rows that are
done commit nothing more, so the step's forward leaves them out. The tokens must stay those of
each prompt alone, and the forwards must really shrink (else the test would pass on the old path).
"""

import pytest

from conftest import load_fixture, spy_forwards
from fixtures import dream, llada, llada2, nemotron, sdar
from mlx_dllm_models import batch_generate_diffusion

PROMPTS = [
    [40, 41, 42, 43, 44, 45, 46],
    [60, 61, 62],
    [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81],
    [90, 91, 92, 93, 94],
]

CASES = {
    "llada, full recompute": (llada.build_llada, dict(cache="none")),
    "dream, full recompute": (dream.build, dict(cache="none")),
    "sdar, block-causal prefix cache": (sdar.build_sdar, dict(cache="auto")),
    "llada2, block-causal prefix cache": (llada2.build, dict(cache="auto")),
    "sdar, block-causal full recompute": (sdar.build_sdar, dict(cache="none")),
    "nemotron, causal-prefix cache": (nemotron.build, dict(cache="auto")),
    "nemotron, causal-prefix recompute": (nemotron.build, dict(cache="none")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rows_done_with_a_block_leave_its_forwards(name, tmp_path):
    build, extra = CASES[name]
    model, tok = load_fixture(build(tmp_path / "ckpt"))
    kw = dict(max_tokens=16, block_length=8, temperature=0, sampler="threshold", threshold=0.95)
    kw.update(extra)
    widths = []

    def record(inputs, cache, mask, head_span):
        widths.append(inputs.shape[0])

    with spy_forwards(model, record):
        batch = batch_generate_diffusion(model, tok, PROMPTS, **kw)
    # Some step ran over fewer rows than a later forward: rows left out within a block, not only
    # rows that finished and left the batch (those never come back). The prompts need different
    # numbers of steps per block at this threshold, alone.
    assert any(w < max(widths[i:]) for i, w in enumerate(widths)), widths
    for prompt, got, reason in zip(PROMPTS, batch.tokens, batch.finish_reasons):
        alone = batch_generate_diffusion(model, tok, [prompt], **kw)
        assert got == alone.tokens[0], name
        assert reason == alone.finish_reasons[0]
