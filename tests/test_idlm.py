"""What only I-DLM has: its causal forward against transformers' Qwen3 over the published weights,
Introspective Strided Decoding's tokens and forwards against a transcription of the authors'
`IDLMBlockN` (reference/idlm_torch.py) at its defaults (N = 4, temperature 0) and at other N, on a
fixture whose drafts are mostly rejected and on one whose drafts are mostly kept, a batch's rows
against their single runs, and the published config (model_type "sdar") reached through
`mlx_dllm convert --model-type idlm`. The rows every family shares are in tests/test_conformance.py."""

import json

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures import idlm as fixture
from helpers import assert_close, far
from mlx_dllm_models import batch_generate_diffusion, load
from mlx_dllm_models.conversion import retyped_config
from mlx_dllm_models.decoding.idlm import draft_tokens, target_distributions
from mlx_dllm_models.engine.base import BlockEvent
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.settings import resolve_settings
from reference import idlm_torch as reference


@pytest.fixture(scope="module")
def published(fixture_dir):
    return build_once(fixture_dir / "idlm_published", fixture.build)


@pytest.fixture(scope="module")
def agreeing_published(fixture_dir):
    return build_once(
        fixture_dir / "idlm_agreeing_published", fixture.build_agreeing, retyped=False
    )


@pytest.fixture(scope="module")
def loaded(fixture_dir):
    return load(build_once(fixture_dir / "idlm", fixture.build_converted))


@pytest.fixture(scope="module")
def agreeing(fixture_dir):
    return load(build_once(fixture_dir / "idlm_agreeing", fixture.build_agreeing))


def run(model, tok, prompts, **settings):
    """Each row's tokens and the decoder (its forward and draft counters)."""
    _, ids, decoder = stream_events(model, tok, prompts, **settings)
    out = [[] for _ in prompts]
    for event in decoder.run(ids):
        if isinstance(event, BlockEvent):
            for row, tokens in zip(event.rows, event.tokens):
                out[row].extend(tokens)
    return out, decoder


@pytest.mark.parametrize("length", [1, 9, 16])
def test_the_plain_call_is_the_causal_forward(published, loaded, length):
    model, _ = loaded
    ids = np.random.default_rng(length).integers(0, 256, (2, length))
    ids[:, length // 2 :] = fixture.MASK
    ours = model(mx.array(ids))
    assert_close(ours, reference.causal_logits(published, ids))
    assert_close(model(mx.array(ids), mask="causal"), np.array(ours))
    if length > 1:
        assert far(ours, reference.reference_logits(published, ids))


def test_defaults_are_the_authors_recipe(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert dict(spec.defaults) == {
        "block_length": 4,
        "sampler": "idlm",
        "temperature": 0.0,
        "top_k": 50,
        "top_p": 0.95,
        "max_tokens": 512,
    }
    assert (spec.decoder, spec.logit_shift, spec.mask_token_id) == ("idlm", 1, fixture.MASK)
    # config.json's <|im_end|>, then generation_config.json's <|endoftext|> (Qwen3's pair).
    assert spec.eos_token_ids == (fixture.EOS, fixture.ENDOFTEXT)
    resolved = resolve_settings(spec, {}, {})
    assert (resolved.block_length, resolved.temperature) == (4, 0.0)
    # The checkpoint's generation_config (Qwen3's AR sampling values) is not the recipe.
    assert (resolved.top_k, resolved.top_p) == (50, 0.95)


# (fixture, prompt seed, max_tokens, N): the default N = 4 on prompts whose runs end at the EOS
# (seed 2) or at max_tokens, other N, and a budget that ends inside a round.
CASES = [
    ("plain", 0, 40, 4),
    ("plain", 2, 40, 4),
    ("plain", 1, 23, 2),
    ("agreeing", 0, 40, 4),
    ("agreeing", 1, 40, 4),
    ("agreeing", 2, 37, 3),
    ("agreeing", 3, 41, 5),
]


@pytest.mark.slow
@pytest.mark.parametrize("which, seed, max_tokens, n", CASES)
def test_tokens_and_forwards_match_idlm_block_n(
    published, agreeing_published, loaded, agreeing, which, seed, max_tokens, n
):
    ckpt, (model, tok) = (published, loaded) if which == "plain" else (agreeing_published, agreeing)
    prompt = np.random.default_rng(seed).integers(0, 256, 7).tolist()
    want, forwards = reference.isd_generate(
        ckpt, prompt, max_tokens, n, fixture.MASK, {fixture.EOS, fixture.ENDOFTEXT}
    )
    settings = {} if n == 4 else {"block_length": n}
    (got,), dec = run(model, tok, [prompt], max_tokens=max_tokens, **settings)
    assert got == want
    assert dec.nfe == forwards
    if which == "agreeing":
        assert dec.accepted > 0
    if (which, seed) == ("plain", 2):  # the run that ends at its EOS
        assert len(got) < max_tokens


def test_kept_drafts_save_forwards(agreeing):
    model, tok = agreeing
    prompt = np.random.default_rng(0).integers(0, 256, 7).tolist()
    (strided,), dec = run(model, tok, [prompt], max_tokens=40)
    assert 0 < dec.accepted < dec.drafted  # both branches of the verify ran
    (one_a_forward,), single = run(model, tok, [prompt], max_tokens=40, block_length=1)
    assert strided == one_a_forward  # greedy AR tokens either way
    assert single.nfe == 40 and dec.nfe < 30


def test_a_batch_rows_are_their_single_runs(agreeing):
    model, tok = agreeing
    prompts = [np.random.default_rng(s).integers(0, 256, 3 + 4 * s).tolist() for s in range(3)]
    together = batch_generate_diffusion(model, tok, prompts, max_tokens=24).tokens
    alone = [batch_generate_diffusion(model, tok, [p], max_tokens=24).tokens[0] for p in prompts]
    assert together == alone


def test_sampling_verifies_with_the_tempered_and_keeps_the_clean_row():
    logits = mx.array(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    clean = mx.full((8,), 1 / 8)
    p = target_distributions(logits, 0.5, clean)
    assert_close(p[:2], mx.softmax(logits[:2] / 0.5, axis=-1))
    assert_close(p[2], clean)
    assert draft_tokens(logits).tolist() == np.argmax(np.array(logits), axis=-1).tolist()
    assert draft_tokens(logits[:0]).tolist() == []


def test_sampled_runs_are_seeded(loaded):
    model, tok = loaded
    a = batch_generate_diffusion(model, tok, ["Hi"], max_tokens=16, temperature=1.0, seed=5)
    b = batch_generate_diffusion(model, tok, ["Hi"], max_tokens=16, temperature=1.0, seed=5)
    assert a.tokens == b.tokens and len(a.tokens[0]) > 0


def test_convert_model_type_idlm_retypes_an_sdar_checkpoint(published):
    assert json.loads((published / "config.json").read_text())["model_type"] == "sdar"
    assert retyped_config(published, "idlm") == {"model_type": "idlm"}
    # Unconverted, it is what its config says: SDAR.
    model, _ = load(published)
    assert model.diffusion_spec.family == "sdar"


def test_full_recompute_decodes_as_the_kv_cache(agreeing):
    model, tok = agreeing
    prompts = [np.random.default_rng(s).integers(0, 256, 5 + 3 * s).tolist() for s in range(2)]
    cached, dec = run(model, tok, prompts, max_tokens=24)
    recomputed, dec_none = run(model, tok, prompts, max_tokens=24, cache="none")
    assert recomputed == cached and dec_none.nfe == dec.nfe
