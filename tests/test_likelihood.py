"""likelihood.py: the Monte-Carlo ELBO of LLaDA's get_log_likelihood.py and Dream's eval.py, equal to
plain transcriptions given the same draws; on the trained default model it ranks the right sum
first and its spread falls with mc_samples; LLaDA's suffix greedy check; errors."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures.dream import MASK as DREAM_MASK
from fixtures.dream import build as build_dream
from fixtures.llada import CHECKPOINTS as LLADA
from helpers import load_fixture
from mlx_dllm_models import load
from mlx_dllm_models.default import chat_prompt, default_checkpoint, held_out_problems
from mlx_dllm_models.likelihood import (
    draw_keys,
    greedy_matches,
    llada_draws,
    log_likelihood,
)
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.training import sample_noise
from reference.dream_torch import dream_log_likelihood
from reference.llada_torch import get_log_likelihood, suffix_greedy_prediction

PROMPT = [40, 41, 42, 43, 44]
ANSWER = [50, 51, 52, 53, 54, 55, 56]


def _forward(model):
    def forward(ids):
        logits = model(mx.array(np.asarray(ids), dtype=mx.int32))
        return np.array(logits.astype(mx.float32))

    return forward


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return load_fixture(LLADA["llada"](tmp_path_factory.mktemp("llada") / "ckpt"))


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    return load_fixture(build_dream(tmp_path_factory.mktemp("dream") / "ckpt"))


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
@pytest.mark.parametrize("batch_size", [4, 3])
def test_llada_equals_get_log_likelihood_given_the_same_draws(llada, cfg_scale, batch_size):
    model, tok = llada
    mc, seed = 2 * batch_size, 5
    got = log_likelihood(
        model,
        tok,
        PROMPT,
        ANSWER,
        mc_samples=mc,
        batch_size=batch_size,
        cfg_scale=cfg_scale,
        seed=seed,
    )
    draws = [llada_draws(k, batch_size, len(ANSWER)) for k in draw_keys(seed, mc // batch_size)]
    assert len(draws) == 2
    want = get_log_likelihood(
        _forward(model),
        PROMPT,
        ANSWER,
        draws,
        batch_size,
        cfg_scale,
        mask_id=model.diffusion_spec.mask_token_id,
    )
    assert got == pytest.approx(want, rel=1e-4)
    assert got < 0


def test_dream_equals_eval_py_given_the_same_draws(dream):
    model, tok = dream
    batch_size, mc, seed = 4, 8, 2
    eos = model.diffusion_spec.eos_token_ids[0]
    L = len(PROMPT) + len(ANSWER) + 1
    draws = []
    for k in draw_keys(seed, mc // batch_size):
        t, u = sample_noise(k, (batch_size, L), low_discrepancy=True)
        draws.append((np.array(t), np.array(u)))
    want = dream_log_likelihood(
        _forward(model), PROMPT, ANSWER + [eos], draws, batch_size, mask_token_id=DREAM_MASK
    )
    got = log_likelihood(
        model, tok, PROMPT, ANSWER, mc_samples=mc, batch_size=batch_size, seed=seed
    )
    assert got == pytest.approx(want, rel=1e-4)


def test_greedy_matches_is_llada_suffix_greedy_prediction(llada):
    model, tok = llada
    mask_id = model.diffusion_spec.mask_token_id
    # The continuation the check would decode, and a changed one.
    decoded = None
    for answer in (ANSWER, [50] * 4):
        want = suffix_greedy_prediction(_forward(model), PROMPT, answer, mask_id=mask_id)
        assert greedy_matches(model, tok, PROMPT, answer) == want
    from mlx_dllm_models import generate_diffusion

    decoded = tok.encode(
        generate_diffusion(model, tok, PROMPT, max_tokens=4, block_length=4, steps=4),
        add_special_tokens=False,
    )
    if len(decoded) == 4:
        assert greedy_matches(model, tok, PROMPT, decoded)
        assert suffix_greedy_prediction(_forward(model), PROMPT, decoded, mask_id=mask_id)


@pytest.fixture(scope="module")
def default_model():
    return load(default_checkpoint())


@pytest.mark.slow
def test_default_model_ranks_the_right_sum_first(default_model):
    model, tok = default_model
    # Measured: 20/20 on the first 20 problems at mc_samples 8 (18/20 at 4).
    problems = held_out_problems(12)
    right = 0
    for message, answer in problems:
        prompt = chat_prompt(tok, message)
        s = int(answer)
        wrong = [str(s + 1), str(s - 10)]
        scores = [
            log_likelihood(model, tok, prompt, c, mc_samples=8, batch_size=8)
            for c in [answer] + wrong
        ]
        right += scores[0] > max(scores[1:])
    assert right >= 0.9 * len(problems), f"{right}/{len(problems)}"


def test_estimator_spread_falls_with_mc_samples(llada):
    """Across seeds, the estimate's standard deviation falls as mc_samples grows (measured on this
    fixture: about 26 nats at 1 sample, 6.5 at 64)."""
    model, tok = llada

    def spread(mc, batch):
        runs = [
            log_likelihood(model, tok, PROMPT, ANSWER, mc_samples=mc, batch_size=batch, seed=s)
            for s in range(8)
        ]
        return float(np.std(runs))

    few, many = spread(1, 1), spread(64, 16)
    assert many < few / 2, (few, many)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(mc_samples=10, batch_size=4), "multiple of batch_size"),
        (dict(mc_samples=0), "positive integer"),
        (dict(cfg_scale=-1.0), "cfg_scale must be"),
    ],
)
def test_bad_arguments(llada, kw, words):
    model, tok = llada
    with pytest.raises(SettingsError, match=words):
        log_likelihood(model, tok, PROMPT, ANSWER, **kw)


def test_empty_continuation_and_dream_guidance(llada, dream):
    model, tok = llada
    with pytest.raises(SettingsError, match="continuation is empty"):
        log_likelihood(model, tok, PROMPT, [])
    model, tok = dream
    with pytest.raises(SettingsError, match="LLaDA's"):
        log_likelihood(model, tok, PROMPT, ANSWER, cfg_scale=1.0)


def test_other_families_are_refused(tmp_path_factory):
    from fixtures.sdar import CHECKPOINTS

    model, tok = load_fixture(CHECKPOINTS["sdar"](tmp_path_factory.mktemp("sdar") / "ckpt"))
    with pytest.raises(SettingsError, match="no such estimator"):
        log_likelihood(model, tok, PROMPT, ANSWER)
    with pytest.raises(SettingsError, match="no such estimator"):
        greedy_matches(model, tok, PROMPT, ANSWER)
