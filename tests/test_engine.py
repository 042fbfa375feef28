"""Behaviour of the masked block engine and the public API on a tiny LLaDA checkpoint."""

import dataclasses

import pytest

from helpers import spy_forwards
from mlx_dllm_models import (
    batch_generate_diffusion,
    generate_diffusion,
    load,
    stream_generate_diffusion,
)
from mlx_dllm_models.tiny import build_tiny_llada


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    path = build_tiny_llada(tmp_path_factory.mktemp("tiny") / "llada")
    model, tokenizer = load(path)
    return model, tokenizer


PROMPT = [40, 41, 42, 43, 44, 45, 46]


def _tokens(model, tok, prompt=PROMPT, **kw):
    out = []
    for r in stream_generate_diffusion(model, tok, prompt, **kw):
        out.extend(r.tokens)
    return out, r


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_tokens=8, block_length=32, steps=2),  # fewer steps than masks, short request
        dict(max_tokens=20, block_length=8, steps=3),  # last block shorter than block_length
        dict(max_tokens=16, block_length=16, steps=1),
        dict(max_tokens=17, block_length=5, steps=64, sampler="threshold", threshold=1.0),
        dict(max_tokens=12, block_length=4, steps=2, sampler="factor", factor=0.01),
        dict(max_tokens=12, block_length=6, steps=2, sampler="entropy", entropy_bound=0.0),
        dict(max_tokens=9, block_length=9, steps=3, temperature=1.0, seed=3),
    ],
)
def test_no_mask_ever_reaches_the_output(llada, kw):
    model, tok = llada
    mask = model.diffusion_spec.mask_token_id
    toks, last = _tokens(model, tok, **kw)
    assert mask not in toks
    assert last.finish_reason in ("stop", "length")
    if last.finish_reason == "length":
        assert len(toks) == kw["max_tokens"]


def test_quota_commits_exactly_the_schedule_per_step(llada):
    model, tok = llada
    # 16 masks over 4 steps: one forward per step, 4 tokens each.
    toks, last = _tokens(model, tok, max_tokens=16, block_length=16, steps=4)
    assert last.nfe == 4 and last.tokens_per_forward == 4.0
    # steps > masks: zero-quota steps are skipped, not run.
    toks, last = _tokens(model, tok, max_tokens=8, block_length=8, steps=32)
    assert last.nfe == 8


def test_threshold_commits_several_tokens_per_forward(llada):
    model, tok = llada
    _, quota = _tokens(model, tok, max_tokens=32, block_length=16, steps=16)
    _, thr = _tokens(
        model, tok, max_tokens=32, block_length=16, steps=16, sampler="threshold", threshold=0.7
    )
    assert quota.nfe == 32
    assert thr.nfe < quota.nfe, "fixture head not confident enough: threshold never beats quota"


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(llada):
    model, tok = llada
    a, _ = _tokens(model, tok, max_tokens=16, block_length=8, steps=4)
    b, _ = _tokens(model, tok, max_tokens=16, block_length=8, steps=4)
    assert a == b
    c, _ = _tokens(model, tok, max_tokens=16, block_length=8, steps=4, temperature=1.0, seed=7)
    d, _ = _tokens(model, tok, max_tokens=16, block_length=8, steps=4, temperature=1.0, seed=7)
    e, _ = _tokens(model, tok, max_tokens=16, block_length=8, steps=4, temperature=1.0, seed=8)
    assert c == d and c != e


def test_stream_is_live(llada):
    """A consumer receives block 1 before block 2 is computed."""
    model, tok = llada
    calls = []
    with spy_forwards(model, lambda *a: calls.append(1)):
        stream = stream_generate_diffusion(
            model, tok, PROMPT, max_tokens=24, block_length=8, steps=4
        )
        first = next(stream)
        assert len(first.tokens) > 0 and first.nfe == 4
        assert len(calls) == 4, "the second block was computed before the first was delivered"
        rest = list(stream)
        assert len(calls) == 12 and rest[-1].finish_reason is not None


def test_stop_at_eos_is_not_returned(llada):
    model, tok = llada
    full, _ = _tokens(model, tok, max_tokens=24, block_length=8, steps=8)
    eos_tok = full[10]
    # Declare a token the model produces in block 2 as an EOS: output is cut right before it.
    spec = model.diffusion_spec
    model.diffusion_spec = dataclasses.replace(spec, eos_token_ids=(eos_tok,))
    try:
        toks, last = _tokens(model, tok, max_tokens=24, block_length=8, steps=8)
    finally:
        model.diffusion_spec = spec
    first = full.index(eos_tok)
    assert toks == full[:first]
    assert last.finish_reason == "stop"
    assert last.nfe == 8 * (first // 8 + 1), "did not stop after the block holding the EOS"


def test_batch_equals_one_by_one(llada):
    model, tok = llada
    prompts = [PROMPT, [50, 51, 52], [60] * 11]
    kw = dict(max_tokens=16, block_length=8, steps=4, sampler="threshold", threshold=0.8)
    batch = batch_generate_diffusion(model, tok, prompts, **kw)
    reasons = []
    for p, got in zip(prompts, batch.tokens):
        alone, last = _tokens(model, tok, p, **kw)
        assert got == alone
        reasons.append(last.finish_reason)
    assert batch.finish_reasons == reasons


def test_text_prompt_and_generate_string(llada):
    model, tok = llada
    text = generate_diffusion(model, tok, "hello", max_tokens=8, block_length=8, steps=8)
    ids = tok.encode("hello")
    toks, _ = _tokens(model, tok, ids, max_tokens=8, block_length=8, steps=8)
    assert text == tok.decode(toks)


def test_head_runs_only_over_the_block(llada):
    model, tok = llada
    seen = []
    with spy_forwards(
        model, lambda inputs, c, m, head_span: seen.append((inputs.shape[1], head_span))
    ):
        _tokens(model, tok, max_tokens=16, block_length=8, steps=2)
    P = len(PROMPT)
    assert seen == [(P + 16, (P, P + 8))] * 2 + [(P + 16, (P + 8, P + 16))] * 2
