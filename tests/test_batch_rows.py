"""A batch step runs its forward over the rows that still have masks in the block (issue #14 §4).

With a threshold sampler, rows finish a block after different numbers of steps; the rows that are
done commit nothing more, so the step's forward leaves them out. The tokens must stay those of
each prompt alone, and the forwards must really shrink (else the test would pass on the old path).
"""

import mlx.core as mx
import pytest

from fixtures import dream, llada, llada2, nemotron, sdar
from helpers import load_fixture, spy_forwards
from mlx_dllm_models import batch_generate_diffusion
from mlx_dllm_models.engine.block_cache import PrefixCache

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


def test_row_subsets_keep_one_host_read_per_step(tmp_path, monkeypatch):
    """The step's one read (which rows have masks left) is all that row subsets need: a batch
    reads the device no more often with them than with every step over the whole batch."""
    model, tok = load_fixture(sdar.build_sdar(tmp_path / "ckpt"))
    kw = dict(max_tokens=16, block_length=8, temperature=0, sampler="threshold", threshold=0.95)
    reads = []
    for name in ("item", "tolist"):
        real = getattr(mx.array, name)
        monkeypatch.setattr(mx.array, name, lambda a, _r=real: reads.append(1) or _r(a))

    def run():
        widths = []
        reads.clear()
        with spy_forwards(model, lambda inputs, *_: widths.append(inputs.shape[0])):
            batch_generate_diffusion(model, tok, PROMPTS, **kw)
        return len(reads), widths

    with_subsets, widths = run()
    assert any(w < max(widths[i:]) for i, w in enumerate(widths)), widths
    monkeypatch.setattr(PrefixCache, "row_steps", False)
    without, full = run()
    assert len(full) == len(widths)  # the same steps, each over the whole batch
    assert with_subsets <= without, (with_subsets, without)
