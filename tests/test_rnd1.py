"""RND1 (radicalnumerics/RND1-Base-0910): the forward against transformers' Qwen3-MoE read
bidirectionally, sampler "rnd1" against a transcription of rnd/sampling.py
(tests/reference/rnd1_sampling.py), the recipe, plain `mlx_lm convert` / `mlx_lm.load`, batches,
sharding and serve."""

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.rnd1 import ENDOFTEXT, IM_END, MASK, build
from helpers import batch_equal_to_single_runs, checkpoint_fixtures, decoded
from helpers import random_prompt as prompt
from mlx_dllm_models import SettingsError, batch_generate_diffusion
from mlx_dllm_models.decoding import rnd1 as rnd1_rules
from mlx_dllm_models.engine import make_decoder
from mlx_dllm_models.models import rnd1
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import family_settings, resolve_settings
from mlx_dllm_models.settings_fields import ResolvedSettings
from reference.rnd1_sampling import generate, reference_forward

DATA = Path(__file__).parent / "data" / "radicalnumerics__RND1-Base-0910"


ckpt, loaded = checkpoint_fixtures("rnd1", build)


# ------------------------------------------------------------------------------------ forward


def test_spec_and_defaults_are_the_readme_recipe(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert spec.samplers[0] == "rnd1"
    s = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    assert (s.sampler, s.temperature, s.top_p, s.top_k) == ("rnd1", 0.01, None, None)
    assert s.eb_gamma is None  # RND1GenerationConfig's default: the quota schedule
    assert (s.max_tokens, s.steps, s.block_length) == (256, 256, 256)
    assert resolve_settings(spec, {"max_tokens": 40}, {}).block_length == 40
    q = resolve_settings(spec, {"sampler": "quota"}, {})
    assert (q.block_length, q.steps) == (32, 32)


# --------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 12, 64, 100, 256])
def test_schedule_is_the_references_float32_arithmetic(steps):
    masks = np.array([1, 5, 12, 31, 100, 255])
    got = np.array(rnd1_rules.rnd1_schedule(mx.array(masks), steps, ResolvedSettings.from_dict({})))
    for m, row in zip(masks, got):
        total = torch.tensor([[int(m)]])
        left, want = int(m), []
        for step in range(steps - 1, 0, -1):
            kept = int((total * (step / steps)).long().clamp(min=0))
            want.append(left - kept)
            left = kept
        want.append(left)
        row = row.tolist() + [0] * (steps - len(row))
        assert row == want and sum(row) == m


def test_too_many_steps_is_a_clear_error(loaded):
    model, tok = loaded
    with pytest.raises(SettingsError, match="steps <= 1048576"):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, steps=1 << 21)


# --------------------------------------------------------------------------------- decoding


def ours(model, prompts, **kw):
    spec = model.diffusion_spec
    settings = resolve_settings(spec, {"temperature": 0.0, **kw}, {})
    decoder = make_decoder(model, settings, eos_token_ids=(), suffix=[ENDOFTEXT])
    return decoded(decoder, prompts)


def reference(ckpt, p, max_tokens, steps, **kw):
    """The reference's generate(max_new_tokens=max_tokens + 1): max_tokens masks, then the pad
    its layout reserves (the engine's canvas with suffix=[pad])."""
    kw = {"greedy": True, "temperature": 1.0, **kw}
    seq, nfe = generate(
        reference_forward(ckpt),
        p,
        max_tokens + 1,
        steps,
        mask_token_id=MASK,
        eos_token_id=IM_END,
        pad_token_id=ENDOFTEXT,
        **kw,
    )
    assert seq[-1] == ENDOFTEXT and not (seq == MASK).any()
    return seq[len(p) : -1].tolist(), nfe


CASES = [(7, 0, 12, 12), (3, 1, 16, 5), (10, 2, 9, 20), (5, 3, 24, 256)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{c[0]}-N{c[2]}-S{c[3]}")
def test_greedy_tokens_match_the_reference(loaded, ckpt, case):
    """Temperature 0 here is the reference's greedy=True read at temperature 1 (its temperature 0
    divides by 1e-8: every entropy is 0 and torch.topk's order among ties decides)."""
    n, seed, max_tokens, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    want, ref_nfe = reference(ckpt, p, max_tokens, steps)
    got, nfe = ours(model, [p], max_tokens=max_tokens, steps=steps)
    assert got[0] == want
    # The reference runs a forward at every step while masks are left; steps that commit nothing
    # are skipped here.
    counts = np.array(
        rnd1_rules.rnd1_schedule(mx.array([max_tokens]), steps, ResolvedSettings.from_dict({}))
    )
    assert nfe == int((counts > 0).sum()) <= min(steps, max_tokens) and nfe <= ref_nfe <= steps


@pytest.mark.parametrize("gamma", [0.0, 0.3, 2.0])
def test_entropy_bounded_variant_matches_the_reference(loaded, ckpt, gamma):
    model, _ = loaded
    p = prompt(8, 4)
    want, ref_nfe = reference(ckpt, p, 14, 10, eb_gamma=gamma)
    got, nfe = ours(model, [p], max_tokens=14, steps=10, eb_gamma=gamma)
    assert got[0] == want and nfe == ref_nfe
    if gamma == 2.0:  # a larger budget commits more per step: fewer forwards
        assert nfe < ours(model, [p], max_tokens=14, steps=10, eb_gamma=0.0)[1]


def test_eb_gamma_settings(loaded):
    model, tok = loaded
    assert family_settings("rnd1") == ("eb_gamma",)
    with pytest.raises(SettingsError, match="eb_gamma must be"):
        batch_generate_diffusion(model, tok, [[40]], max_tokens=4, eb_gamma=-1.0)
    with pytest.raises(SettingsError, match="eb_gamma only acts with sampler='rnd1'"):
        batch_generate_diffusion(model, tok, [[40]], max_tokens=4, sampler="quota", eb_gamma=1.0)


def test_the_parity_check_can_fail(loaded, ckpt):
    model, _ = loaded
    p = prompt(7, 0)
    want, _ = reference(ckpt, p, 12, 12)
    spec = model.diffusion_spec
    model.diffusion_spec = dataclasses.replace(spec, logit_shift=0)
    try:
        assert ours(model, [p], max_tokens=12, steps=12)[0][0] != want
    finally:
        model.diffusion_spec = spec
    # Committing the highest-entropy masks (the set the reference keeps) gives other tokens too.
    from mlx_dllm_models.decoding.rules import quota_commit

    with pytest.MonkeyPatch.context() as m:
        m.setattr(rnd1_rules, "quota_commit", lambda c, cand, k: quota_commit(-c, cand, k))
        assert ours(model, [p], max_tokens=12, steps=12)[0][0] != want


def test_temperature_zero_of_the_reference_ranks_nothing(ckpt):
    """Why temperature 0 reads the unscaled entropy: at the reference's 1e-8 every entropy of the
    fixture's canvas is exactly 0."""
    x = torch.tensor([prompt(7, 0) + [MASK] * 12 + [ENDOFTEXT]])
    logp = torch.log_softmax(reference_forward(ckpt)(x) / 1e-8, dim=-1)
    assert float((-(logp.exp() * logp).sum(-1)).abs().max()) == 0.0


class _Gumbel:
    """The categorical draws on both sides from one Gumbel table per forward: the engine's Gumbel
    noise is -log(-log(u)) of its uniform draw over the canvas, the reference takes
    argmax(logp + G) (the Categorical's distribution) with the same G at the position that
    predicts each canvas token."""

    def __init__(self, steps, n_prompt, width, vocab, seed):
        u = np.random.default_rng(seed).random((steps, width, vocab)).astype(np.float32)
        self.u = np.clip(u, 1e-20, 1.0)
        self.n, self.i, self.j = n_prompt, 0, 0

    def uniform(self, low=0.0, high=1.0, shape=(), key=None, **kw):
        assert tuple(shape)[1:] == self.u.shape[1:], shape
        self.i += 1
        return mx.array(self.u[self.i - 1][None])

    def multinomial(self, probs, num, generator=None):
        g = -np.log(-np.log(self.u[self.j]))
        self.j += 1
        full = np.zeros(probs.shape, np.float32)
        full[self.n - 1 : self.n - 1 + g.shape[0]] = g
        return (torch.log(probs) + torch.from_numpy(full)).argmax(-1, keepdim=True)


@pytest.mark.parametrize("temperature", [1.5, 3.0])
def test_sampled_tokens_match_the_reference_with_the_same_draws(
    loaded, ckpt, monkeypatch, temperature
):
    model, _ = loaded
    p, max_tokens, steps = prompt(6, 9), 10, 5
    draws = _Gumbel(steps, len(p), max_tokens, model.args.vocab_size, seed=int(temperature * 10))
    with monkeypatch.context() as m:
        m.setattr(torch, "multinomial", draws.multinomial)
        want, _ = reference(ckpt, p, max_tokens, steps, greedy=False, temperature=temperature)
    monkeypatch.setattr(mx.random, "uniform", draws.uniform)
    got, nfe = ours(model, [p], max_tokens=max_tokens, steps=steps, temperature=temperature)
    assert got[0] == want and draws.i == draws.j == nfe == steps
    assert got[0] != ours(model, [p], max_tokens=max_tokens, steps=steps)[0][0]


def test_batch_rows_of_different_lengths_equal_single_runs(loaded):
    model, tok = loaded
    prompts = [prompt(9, 10), prompt(3, 11), prompt(14, 12)]
    # One run of three rows, left-padded, at the recipe's temperature 0.01: each row samples
    # from a stream of its own seed, as it would alone.
    kw = dict(max_tokens=12, steps=6)
    batch = batch_equal_to_single_runs(model, tok, prompts, **kw)
    assert any(len(t) > 1 for t in batch.tokens)
    # The draws matter here: at temperature 1 the rows still equal their single runs.
    hot = dict(kw, temperature=1.0)
    batch = batch_equal_to_single_runs(model, tok, prompts, **hot)
    assert batch.tokens != batch_generate_diffusion(model, tok, prompts, seed=3, **hot).tokens


def test_rnd1_sampler_needs_no_dream_settings(loaded):
    model, tok = loaded
    with pytest.raises(
        SettingsError, match="alg is a setting of the dream / coda / open_dcoder family"
    ):
        batch_generate_diffusion(model, tok, [[40]], max_tokens=4, alg="entropy")


# ------------------------------------------------------------------- mlx-lm, sharding, serve


# ------------------------------------------------------------------- the reconstructed config


def test_reconstructed_config_builds_the_full_model_lazily():
    from mlx.utils import tree_flatten

    cfg = json.loads((DATA / "config.json").read_text())
    args = rnd1.ModelArgs.from_dict(cfg)
    assert args.rope_scaling is None and args.norm_topk_prob is True
    model = rnd1.Model(args)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 30.0e9 < count < 31.0e9  # Qwen3-30B-A3B: 30.5e9
    spec = model.diffusion_spec
    assert (spec.mask_token_id, spec.eos_token_ids, spec.max_position_embeddings) == (
        151669,
        (151645,),
        40960,
    )
