"""Token parity at temperature 0 of LLaDA decoding with independent transcriptions of the references
(LLaDA generate.py's low-confidence remasking; Fast-dLLM's threshold rule), run on transformers'
forward of the same weights (and on ours, which separates sampler logic from forward numerics)."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.llada import CHECKPOINTS
from helpers import load_fixture
from mlx_dllm_models import batch_generate_diffusion, stream_generate_diffusion
from reference.llada_torch import llada_generate, torch_forward

PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [100, 7, 7, 200, 13], [33] * 12]


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def llada(request, tmp_path_factory):
    path = CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt")
    model, tok = load_fixture(path)
    return path, model, tok


def _mlx_forward(model):
    def forward(ids):
        logits = model(mx.array(np.asarray(ids), dtype=mx.int32))
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    return forward


def _ours(model, tok, prompt, **kw):
    out, last = [], None
    for last in stream_generate_diffusion(model, tok, prompt, **kw):
        out.extend(last.tokens)
    return out, last


def _reference_tokens(x, prompt_len, eos_ids):
    gen = [int(t) for t in x[0, prompt_len:]]
    cut = next((i for i, t in enumerate(gen) if t in eos_ids), None)
    return gen if cut is None else gen[:cut]


@pytest.mark.slow
@pytest.mark.parametrize("forward_kind", ["transformers", "ours"])
@pytest.mark.parametrize(
    "gen_length, block_length, steps_total",
    [(32, 8, 16), (24, 24, 24), (32, 16, 8)],
)
def test_quota_matches_llada_generate(llada, forward_kind, gen_length, block_length, steps_total):
    path, model, tok = llada
    spec = model.diffusion_spec
    forward = torch_forward(path) if forward_kind == "transformers" else _mlx_forward(model)
    n_blocks = gen_length // block_length
    committed_per_step = []
    for prompt in PROMPTS:
        x = llada_generate(
            forward,
            torch.tensor([prompt]),
            steps=steps_total,
            gen_length=gen_length,
            block_length=block_length,
            mask_id=spec.mask_token_id,
        )
        want = _reference_tokens(x, len(prompt), set(spec.eos_token_ids))
        got, last = _ours(
            model,
            tok,
            prompt,
            max_tokens=gen_length,
            block_length=block_length,
            steps=steps_total // n_blocks,
            sampler="quota",
        )
        assert got == want
        committed_per_step.append(last.tokens_per_forward)
    if steps_total // n_blocks < block_length:
        # the schedule commits several tokens per step here: not a one-token-per-step case
        assert max(committed_per_step) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("forward_kind", ["transformers", "ours"])
@pytest.mark.parametrize("threshold", [0.9, 0.6])
def test_threshold_matches_fast_dllm(llada, forward_kind, threshold):
    path, model, tok = llada
    spec = model.diffusion_spec
    forward = torch_forward(path) if forward_kind == "transformers" else _mlx_forward(model)
    tpf = []
    for prompt in PROMPTS:
        x, nfe = llada_generate(
            forward,
            torch.tensor([prompt]),
            steps=32,
            gen_length=32,
            block_length=16,
            mask_id=spec.mask_token_id,
            threshold=threshold,
            return_nfe=True,
        )
        want = _reference_tokens(x, len(prompt), set(spec.eos_token_ids))
        got, last = _ours(
            model,
            tok,
            prompt,
            max_tokens=32,
            block_length=16,
            steps=16,
            sampler="threshold",
            threshold=threshold,
        )
        assert got == want
        if len(want) == 32:
            assert last.nfe == nfe
        tpf.append(last.tokens_per_forward)
    assert max(tpf) > 1.5, "fixture not confident enough to commit several tokens per forward"


def test_batch_matches_reference_per_row(llada):
    path, model, tok = llada
    spec = model.diffusion_spec
    forward = _mlx_forward(model)
    batch = batch_generate_diffusion(
        model, tok, PROMPTS, max_tokens=16, block_length=8, steps=4, sampler="quota"
    )
    for prompt, got in zip(PROMPTS, batch.tokens):
        x = llada_generate(
            forward,
            torch.tensor([prompt]),
            steps=8,
            gen_length=16,
            block_length=8,
            mask_id=spec.mask_token_id,
        )
        assert got == _reference_tokens(x, len(prompt), set(spec.eos_token_ids))
