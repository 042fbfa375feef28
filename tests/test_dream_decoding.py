"""Dream's decoding on the engine: token parity of sampler="dream" (Dream's diffusion_generate, four
algorithms) with a plain transcription of the reference on the torch forward, the shared samplers
block-wise, batching, settings and errors, the CLI."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.dream import ENDOFTEXT, IM_END, MASK, build
from helpers import checkpoint_fixtures, decoded, run_cli
from helpers import random_prompt as prompt
from mlx_dllm_models import batch_generate_diffusion, stream_generate_diffusion
from mlx_dllm_models.decoding import dream as dream_rules
from mlx_dllm_models.decoding.schedule import transfer_schedule
from mlx_dllm_models.engine import BlockEvent, StepEvent, make_decoder
from mlx_dllm_models.request import checkpoint_settings, eos_ids
from mlx_dllm_models.settings import SettingsError, resolve_settings
from mlx_dllm_models.settings_fields import ResolvedSettings
from reference.dream_torch import dream_generate, reference_forward

ROOT = Path(__file__).resolve().parents[1]


ckpt, dream = checkpoint_fixtures("dream", build, loaded="dream")


def settings_for(model, **kw):
    # Greedy, no top-p (1.0 turns it off): the reference transcription's defaults; the family's
    # are the README's sampled recipe (test_defaults_are_the_readme_recipe).
    kw = {"temperature": 0.0, "top_p": 1.0, **kw}
    spec = model.diffusion_spec
    return resolve_settings(spec, kw, checkpoint_settings(model, spec))


def ours(model, prompts, **kw):
    """Full canvases (no EOS cut) and the forward count of the engine."""
    decoder = make_decoder(model, settings_for(model, **kw), eos_token_ids=())
    return decoded(decoder, prompts)


_REFERENCE = {}


def reference(ckpt, p, max_tokens, steps, **kw):
    key = (str(ckpt), tuple(p), max_tokens, steps, tuple(sorted(kw.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference(ckpt, p, max_tokens, steps, **kw)
    return _REFERENCE[key]


def _reference(ckpt, p, max_tokens, steps, **kw):
    seq = dream_generate(
        reference_forward(ckpt), np.array([p]), max_tokens, steps, mask_token_id=MASK, **kw
    )
    assert not (seq == MASK).any(), "the reference proposed the mask token: pick another case"
    return seq[0, len(p) :].tolist()


# (prompt length, prompt seed, max_tokens, steps, extra settings)
RANKED_CASES = [
    (7, 0, 8, 8, {}),
    (3, 1, 12, 5, {}),  # fewer steps than tokens: several commits per step
    (10, 2, 10, 24, {}),  # more steps than tokens: steps with a zero count
    # top-k changes the confidences. (top-p is left out: positions where it keeps a single token
    # tie at confidence 1, and torch.topk's order among ties is unspecified.)
    (5, 3, 9, 6, {"top_k": 3}),
]


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("case", RANKED_CASES, ids=lambda c: f"P{c[0]}-N{c[2]}-S{c[3]}")
def test_ranked_algs_match_reference_tokens(dream, ckpt, alg, case):
    n, seed, max_tokens, steps, extra = case
    model, _ = dream
    p = prompt(n, seed)
    want = reference(ckpt, p, max_tokens, steps, alg=alg, **extra)
    got, nfe = ours(model, [p], max_tokens=max_tokens, steps=steps, alg=alg, **extra)
    assert got[0] == want
    # Steps whose count is 0 change nothing and are skipped; the others each take one forward.
    counts = np.array(
        dream_rules.dream_schedule(
            mx.array([max_tokens]), steps, ResolvedSettings.from_dict({"alg": alg, "eps": 1e-3})
        )
    )
    assert nfe == int((counts > 0).sum())


def test_cases_tell_the_algorithms_apart(ckpt):
    """Each pair of ranked algorithms gives different tokens on some case, so a rule that read the
    wrong confidence could not pass the parity test."""
    out = {
        alg: [
            reference(ckpt, prompt(n, seed), N, S, alg=alg, **extra)
            for n, seed, N, S, extra in RANKED_CASES
        ]
        for alg in ("maskgit_plus", "topk_margin", "entropy")
    }
    algs = list(out)
    for i, a in enumerate(algs):
        for b in algs[i + 1 :]:
            assert out[a] != out[b], f"{a} and {b} agree on every case"


class _Draws:
    """The same uniform draws for origin on both sides: U[i] (max_tokens,) at step i; the reference
    reads them at its masks (torch.rand gets only a shape, so its forward records the canvas)."""

    def __init__(self, steps, max_tokens, seed):
        self.u = np.random.default_rng(seed).random((steps, max_tokens)).astype(np.float32)
        self.i = 0
        self.canvas = None

    def ours(self, key, shape):
        assert shape == (1, self.u.shape[1])
        u = mx.array(self.u[self.i][None])
        self.i += 1
        return u

    def forward(self, base):
        def f(x, keep, tok_idx):
            self.canvas = x.clone()
            return base(x, keep, tok_idx)

        return f

    def torch_rand(self, shape, generator=None):
        masks = (self.canvas[0, -self.u.shape[1] :] == MASK).numpy()
        u = torch.from_numpy(self.u[self.i][masks])
        assert tuple(u.shape) == tuple(shape)
        self.i += 1
        return u


@pytest.mark.parametrize("case", [(7, 0, 8, 8), (4, 5, 12, 6), (6, 6, 6, 15)])
def test_origin_matches_reference_with_the_same_draws(dream, ckpt, monkeypatch, case):
    n, seed, max_tokens, steps = case
    model, _ = dream
    p = prompt(n, seed)
    draws = _Draws(steps, max_tokens, seed=seed + 100)
    with monkeypatch.context() as m:
        m.setattr(torch, "rand", draws.torch_rand)
        seq = dream_generate(
            draws.forward(reference_forward(ckpt)),
            np.array([p]),
            max_tokens,
            steps,
            alg="origin",
            mask_token_id=MASK,
        )
    assert draws.i == steps
    draws.i = 0
    monkeypatch.setattr(dream_rules, "uniform", draws.ours)
    got, nfe = ours(model, [p], max_tokens=max_tokens, steps=steps, alg="origin")
    assert got[0] == seq[0, n:].tolist()
    assert nfe == steps == draws.i  # origin draws (and runs) at every step, as the reference


def test_parity_checks_can_fail(dream, ckpt):
    """Without the logit shift, or with the engine's front-loaded schedule in place of Dream's,
    the tokens no longer match the reference."""
    import dataclasses

    model, _ = dream
    p = prompt(7, 0)
    want = reference(ckpt, p, 8, 8, alg="maskgit_plus")
    spec = model.diffusion_spec
    model.diffusion_spec = dataclasses.replace(spec, logit_shift=0)
    try:
        unshifted, _ = ours(model, [p], max_tokens=8, steps=8, alg="maskgit_plus")
    finally:
        model.diffusion_spec = spec
    assert unshifted[0] != want
    dream_counts = np.array(
        dream_rules.dream_schedule(
            mx.array([8]), 8, ResolvedSettings.from_dict({"alg": "maskgit_plus", "eps": 1e-3})
        )
    )
    engine_counts = np.array(transfer_schedule(mx.array([8]), 8))
    assert (
        dream_counts[0, 0] == 0 and engine_counts[0, 0] == 1
    )  # Dream's first step commits nothing


def test_timesteps_and_counts_match_torch():
    for eps in (1e-3, 0.05):
        for steps in (1, 2, 7, 8, 33, 64, 512):
            t = torch.linspace(1, eps, steps + 1).numpy()
            np.testing.assert_array_equal(dream_rules.timesteps(steps, eps), t)
            masks = np.array([1, 5, 8, 31, 128])
            got = np.array(
                dream_rules.dream_schedule(
                    mx.array(masks),
                    steps,
                    ResolvedSettings.from_dict({"alg": "entropy", "eps": eps}),
                )
            )
            for m, row in zip(masks, got):
                left, want = torch.tensor(float(m)), []
                for i in range(steps):
                    s_, t_ = torch.tensor(t[i + 1]), torch.tensor(t[i])
                    k = int(left * (1 - s_ / t_)) if i < steps - 1 else int(left)
                    want.append(k)
                    left = left - k
                assert row.tolist() == want and row.sum() == m


def test_left_padded_batch_matches_reference_and_one_by_one(dream, ckpt):
    model, tok = dream
    prompts = [prompt(9, 10), prompt(4, 11)]
    kw = dict(max_tokens=10, steps=7, alg="entropy")
    batch, _ = ours(model, prompts, **kw)
    for p, got in zip(prompts, batch):
        assert got == ours(model, [p], **kw)[0][0]
    # Dream's own padded batch: pads neither attend nor are attended, positions count real tokens.
    width = max(len(p) for p in prompts)
    ids = np.array([[ENDOFTEXT] * (width - len(p)) + p for p in prompts])
    attention = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    seq = dream_generate(
        reference_forward(ckpt),
        ids,
        10,
        7,
        alg="entropy",
        mask_token_id=MASK,
        attention_mask=attention,
    )
    assert batch == seq[:, width:].tolist()


@pytest.mark.parametrize(
    "kw",
    [
        dict(alg="maskgit_plus", steps=5),
        dict(alg="topk_margin", steps=12),
        dict(sampler="threshold", threshold=0.8, block_length=4, steps=4),
    ],
)
def test_batch_generate_equals_one_by_one(dream, kw):
    model, tok = dream
    prompts = [prompt(6, 20), prompt(2, 21), prompt(11, 22)]
    batch = batch_generate_diffusion(model, tok, prompts, max_tokens=12, **kw)
    for p, got, reason in zip(prompts, batch.tokens, batch.finish_reasons):
        alone = []
        for r in stream_generate_diffusion(model, tok, p, max_tokens=12, **kw):
            alone.extend(r.tokens)
        assert got == alone and reason == r.finish_reason


@pytest.mark.parametrize(
    "kw",
    [
        dict(sampler="quota", steps=3),
        dict(sampler="threshold", threshold=0.9, steps=4),
        dict(sampler="factor", factor=0.5, steps=2),
        dict(sampler="entropy", entropy_bound=0.05, steps=4),
        dict(sampler="threshold", threshold=0.7, steps=4, temperature=0.8, top_p=0.9, seed=3),
    ],
)
def test_shared_samplers_run_block_wise_and_never_leak_masks(dream, kw):
    model, _ = dream
    decoder = make_decoder(model, settings_for(model, max_tokens=12, block_length=4, **kw), ())
    blocks, tokens = [], []
    for event in decoder.run([prompt(5, 30)]):
        if isinstance(event, StepEvent):
            blocks.append(event.block)
        else:
            tokens.extend(event.tokens[0])
    assert sorted(set(blocks)) == [(0, 4), (4, 8), (8, 12)]
    assert blocks == sorted(blocks), "blocks were not decoded in order"
    assert len(tokens) == 12 and MASK not in tokens
    if kw["sampler"] == "quota":
        assert decoder.nfe == 3 * 3


@pytest.mark.parametrize("alg", dream_rules.DREAM_ALGS)
@pytest.mark.parametrize("steps", [1, 3, 40])
def test_dream_sampler_never_leaks_masks(dream, alg, steps):
    model, _ = dream
    got, nfe = ours(
        model,
        [prompt(4, 40)],
        max_tokens=10,
        steps=steps,
        alg=alg,
        temperature=0.7,
        top_p=0.95,
        seed=1,
    )
    assert len(got[0]) == 10 and MASK not in got[0]
    assert nfe <= steps


def test_origin_draws_at_temperature_zero_and_is_seeded(dream):
    model, _ = dream
    p = prompt(6, 50)
    runs = [
        ours(model, [p], max_tokens=12, steps=12, alg="origin", seed=s)[0][0] for s in (0, 0, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2] or runs[0] != runs[3], "origin's transfer draws ignore the seed"


def test_alg_temp_samples_positions(dream):
    model, _ = dream
    p = prompt(6, 60)
    kw = dict(max_tokens=12, steps=6, alg="maskgit_plus")
    greedy = ours(model, [p], **kw)[0][0]
    assert ours(model, [p], alg_temp=1e-7, **kw)[0][0] == greedy  # noise swamped: greedy ranking
    warm = [ours(model, [p], alg_temp=5.0, seed=s, **kw)[0][0] for s in range(3)]
    assert warm[0] == ours(model, [p], alg_temp=5.0, seed=0, **kw)[0][0]
    assert any(w != greedy for w in warm)


def test_margin_and_processed_entropy_follow_the_processed_distribution():
    from mlx_dllm_models.decoding import token_stats

    logits = mx.array([[[3.0, 2.0, 1.0, -1.0]]])
    order = ("temperature", "top_p", "top_k")
    s = token_stats(
        logits,
        temperature=0.5,
        top_k=3,
        key=mx.random.key(0),
        confidence="sampled",
        order=order,
        extras=("margin", "processed_entropy"),
    )
    p = np.exp(np.array([6.0, 4.0, 2.0]))
    p /= p.sum()
    assert np.isclose(float(s.margin[0, 0]), p[0] - p[1], rtol=1e-5)
    assert np.isclose(float(s.processed_entropy[0, 0]), -(p * np.log(p)).sum(), rtol=1e-5)
    x0, conf, ent = s  # still a 3-tuple
    assert token_stats(logits).margin is None
    # Dream tempers before top-p: at T=0.5, 0.9 of the mass sits on the top token alone.
    kept = token_stats(
        logits, temperature=0.5, top_p=0.8, key=mx.random.key(0), confidence="sampled", order=order
    )
    assert np.isclose(float(kept.confidence[0, 0]), 1.0)
    default = token_stats(
        logits, temperature=0.5, top_p=0.8, key=mx.random.key(0), confidence="sampled"
    )
    assert float(default.confidence[0, 0]) < 0.99


# ------------------------------------------------------------------------------------ settings


def test_defaults_are_the_readme_recipe(dream):
    """Dream's README: alg entropy, alg_temp 0, temperature 0.2, top_p 0.95, steps = new tokens.
    The checkpoint's generation_config (DreamGenerationConfig's class defaults: origin, steps 512,
    temperature 0) does not override them; its eps and alg_temp are read."""
    model, _ = dream
    assert model.generation_config["alg"] == "origin" and model.generation_config["steps"] == 512
    spec = model.diffusion_spec
    s = resolve_settings(spec, {"max_tokens": 20}, checkpoint_settings(model, spec))
    assert (s.sampler, s.alg, s.alg_temp, s.eps) == ("dream", "entropy", 0.0, 1e-3)
    assert (s.temperature, s.top_p, s.top_k) == (0.2, 0.95, None)
    assert s.steps == 20 and s.block_length == 20  # steps follow max_tokens
    assert resolve_settings(spec, {"max_tokens": 7}, {}).steps == 7
    assert resolve_settings(spec, {"max_tokens": 20, "steps": 5}, {}).steps == 5
    assert settings_for(model, max_tokens=20, block_length=5).block_length == 5
    assert settings_for(model, max_tokens=20, sampler="quota").block_length == 32
    saved = model.generation_config
    model.generation_config = dict(saved, alg="topk_margin", steps=9, eps=0.01, alg_temp=0.5)
    try:
        s = resolve_settings(spec, {}, checkpoint_settings(model, spec))
        assert (s.alg, s.steps, s.eps, s.alg_temp) == ("entropy", 128, 0.01, 0.5)
        model.generation_config = dict(saved, eps=2.0)
        with pytest.raises(SettingsError, match=r"eps must be in \(0, 1\)"):
            settings_for(model)
        settings_for(model, sampler="quota")  # eps does not act there: not checked
    finally:
        model.generation_config = saved


def test_a_default_request_costs_at_most_one_forward_per_token(dream):
    """The README recipe on its defaults: 16 new tokens, at most 16 denoising forwards (Dream's
    schedule has steps that commit nothing; they cost no forward)."""
    model, tok = dream
    for max_tokens in (16, 5):
        decoder = make_decoder(
            model, resolve_settings(model.diffusion_spec, {"max_tokens": max_tokens}, {}), ()
        )
        events = list(decoder.run([prompt(6, 1)]))
        done = [e for e in events if isinstance(e, BlockEvent)]
        assert sum(len(t) for e in done for t in e.tokens) == max_tokens
        assert 0 < decoder.nfe <= max_tokens
    # Through the public API, with the checkpoint's generation_config (steps 512) attached.
    responses = list(stream_generate_diffusion(model, tok, prompt(6, 1), max_tokens=16))
    assert 0 < responses[-1].nfe <= 16


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(alg="greedy"), "unknown alg 'greedy'.*origin, maskgit_plus, topk_margin, entropy"),
        (dict(eps=0), r"eps must be in \(0, 1\)"),
        (dict(eps=1.0), r"eps must be in \(0, 1\)"),
        (dict(eps=-0.5), r"eps must be in \(0, 1\)"),
        (dict(alg_temp=-1), "alg_temp must be a number >= 0"),
        (dict(sampler="quota", alg="entropy"), "alg only acts with sampler='dream'"),
        (dict(sampler="threshold", eps=0.01), "eps only acts with sampler='dream'"),
        (dict(sampler="entropy", alg_temp=0.1), "alg_temp only acts with sampler='dream'"),
        (dict(sampler="maskgit_plus"), "unknown sampler 'maskgit_plus'.*dream"),
        (dict(threshold=0.5), "threshold only acts with sampler='threshold'"),
    ],
)
def test_bad_settings_are_clear_errors(dream, kw, match):
    model, tok = dream
    with pytest.raises(SettingsError, match=match):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, **kw)


def test_end_of_turn_only_when_the_checkpoint_declares_it(dream):
    model, tok = dream
    spec = model.diffusion_spec
    assert ENDOFTEXT in eos_ids(model, tok, spec) and IM_END not in eos_ids(model, tok, spec)
    saved = model.generation_config
    model.generation_config = dict(saved, eos_token_id=[ENDOFTEXT, IM_END])
    try:
        assert {ENDOFTEXT, IM_END} <= eos_ids(model, tok, spec)
    finally:
        model.generation_config = saved


@pytest.mark.slow
def test_cli_generates_with_dream_settings(ckpt):
    args = ["generate", "--model", str(ckpt), "--prompt", "hi", "--max-tokens", "8"]
    out = run_cli(*args, "--alg", "entropy", "--steps", "8", "--no-live")
    assert out.returncode == 0, out.stderr
    assert "NFE:" in out.stdout
    bad = run_cli(*args, "--alg", "nope", "--no-live")
    assert bad.returncode != 0 and "unknown alg 'nope'" in bad.stderr
