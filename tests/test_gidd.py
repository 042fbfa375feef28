"""GIDD (dvruette/gidd-unif-3b, gidd-mask-3b, gidd-unif-10b) against a transcription of its remote
code (tests/reference/gidd_torch.py): the forward's logits (bidirectional, under generate's
clean / noisy mask, and through the clean prefix's K/V), generate's tokens and forward counts at
its own defaults and at the README's adaptive call with the draws injected, for uniform and masked
noise; the defaults; batch rows equal to single runs; load through plain mlx-lm; one rank."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures import gidd as fixture
from helpers import (
    Ranks,
    assert_close,
    batch_equal_to_single_runs,
    checkpoint_fixtures,
    cut_at_eos,
    decoded,
    far,
    load_fixture,
    random_prompt,
)
from mlx_dllm_models import SettingsError, load
from mlx_dllm_models.engine import gidd as engine_gidd
from mlx_dllm_models.engine.canvas import CanvasNoise
from mlx_dllm_models.engine.registry import make_decoder
from mlx_dllm_models.request import prepare
from mlx_dllm_models.settings import resolve_settings
from reference import gidd_torch as reference

engine_gidd_draw = engine_gidd.draw
BUILDS = {"uniform": fixture.build, "masked": fixture.build_masked}


ckpt, loaded = checkpoint_fixtures("gidd", BUILDS)


def noise_mask_attention(length, clean):
    """generate's mask: noise_mask[i] >= noise_mask[j], the first `clean` positions clean."""
    noisy = np.arange(length) >= clean
    return noisy[:, None] >= noisy[None, :]


def test_logits_match_the_reference(ckpt, loaded):
    model, _ = loaded
    ids = np.random.default_rng(3).integers(0, fixture.VOCAB, (2, 12))
    plain = model(mx.array(ids))
    assert_close(plain, reference.reference_logits(ckpt, ids))
    mask = noise_mask_attention(12, 5)
    ours = model(mx.array(ids), mask=mx.array(mask))
    want = reference.reference_logits(ckpt, ids, np.broadcast_to(mask, (2, 12, 12)))
    assert_close(ours, want)
    assert far(ours[:, :5], plain[:, :5])  # the clean prefix no longer sees the noise


def test_fan_in_scaling_matches_the_reference(fixture_dir):
    path = build_once(fixture_dir / "gidd_fan_in", fixture.build_fan_in)
    model, _ = load(path)
    ids = np.random.default_rng(6).integers(0, fixture.VOCAB, (1, 10))
    ours = model(mx.array(ids))
    assert_close(ours, reference.reference_logits(path, ids))
    published, _ = load(build_once(fixture_dir / "gidd_uniform", fixture.build))
    assert far(ours, published(mx.array(ids)))  # the same weights read with the published scales


def test_the_prefix_cache_is_the_masked_forward(ckpt, loaded):
    model, _ = loaded
    ids = np.random.default_rng(4).integers(0, fixture.VOCAB, (2, 14))
    cache = model.prefix_cache()
    model(mx.array(ids[:, :6]), cache=cache)
    window = model(mx.array(ids[:, 6:]), cache=cache, head_span=(0, 5))
    mask = np.broadcast_to(noise_mask_attention(14, 6), (2, 14, 14))
    assert_close(window, reference.reference_logits(ckpt, ids, mask)[:, 6:11])


class Recorded(CanvasNoise):
    """The decoder's draws, kept in the order it makes them."""

    def __init__(self, seed):
        super().__init__(seed)
        self.draws = []

    def ids(self, rows, length, vocab):
        out = super().ids(rows, length, vocab)
        self.draws.append(np.array(out)[0])
        return out

    def uniform(self, rows, length):
        out = super().uniform(rows, length)
        self.draws.append(np.array(out)[0])
        return out


def run_both(ckpt, model, prompt, monkeypatch, **settings):
    """(our tokens and forwards, the reference's) for one prompt at `settings`, the reference
    drawing what the decoder drew (and told each categorical draw the decoder made, for the
    draws float32 rounding decides: reference._multinomial)."""
    spec = model.diffusion_spec
    s = resolve_settings(spec, settings)
    decoder = make_decoder(model, s, spec.eos_token_ids)
    decoder.noise = Recorded(s.seed)
    ours = []

    def draw(weights, uniforms):
        ours.append(np.array(engine_gidd_draw(weights, uniforms)))
        return mx.array(ours[-1])

    monkeypatch.setattr(engine_gidd, "draw", draw)
    (tokens,), nfe = decoded(decoder, [prompt])
    ours = iter(ours)
    prior_uniforms, prior_ids, *steps = decoder.noise.draws
    steps = iter(steps)
    canvas, ref_nfe, decoded_to = reference.generate(
        ckpt,
        prompt,
        prior_uniforms,
        prior_ids,
        lambda n: next(steps)[:n],
        max_length=s.max_tokens,
        block_length=s.block_length,
        steps=s.steps,
        temperature=s.temperature,
        sampling_method=s.sampler,
        noise_schedule=s.noise_schedule,
        tokens_per_step=s.tokens_per_step,
        top_p=s.top_p,
        top_k=s.top_k,
        theirs=lambda: next(ours),
    )
    assert next(steps, None) is None and next(ours, None) is None  # every draw was read
    # The reference's canvas as the package returns it: the decoded blocks after the prompt,
    # max_tokens at most, cut before the first EOS.
    want = canvas[len(prompt) : min(decoded_to, len(prompt) + s.max_tokens)]
    return (tokens, nfe), (cut_at_eos(want, {fixture.EOS}), ref_nfe)


CALLS = {
    # generate()'s own defaults (ancestral, temperature 1, cosine, block 128, 128 steps): the
    # fixture's context cuts the block at its end.
    "defaults": {},
    # The README's call: adaptive, temperature 0, 256 steps of a 128 block, max_length 128.
    "readme": dict(sampler="adaptive", temperature=0.0, steps=256, max_tokens=128),
    # Several blocks, each a prefix forward and its steps; the linear schedule; top-k / top-p.
    "blocks": dict(block_length=8, steps=8, max_tokens=24, noise_schedule="linear", seed=3),
    "filtered": dict(block_length=8, steps=6, max_tokens=16, top_k=20, top_p=0.9, seed=5),
    "adaptive_sampled": dict(
        sampler="adaptive",
        temperature=0.7,
        block_length=8,
        steps=8,
        tokens_per_step=2,
        max_tokens=32,
        seed=2,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(CALLS))
def test_generate_matches_the_reference(ckpt, loaded, call, monkeypatch):
    model, _ = loaded
    settings = CALLS[call]
    if "masked" in str(ckpt) and settings.get("sampler") == "adaptive":
        # Once a masked block holds no mask, upstream's adaptive step divides by zero (NaN
        # scores, whose top-k is torch's choice): keep to steps that fill the block exactly.
        steps = 8 // settings.get("tokens_per_step", 1)
        settings = dict(settings, steps=steps, block_length=8, max_tokens=24)
    ours, theirs = run_both(ckpt, model, random_prompt(6, 2), monkeypatch, **settings)
    assert ours == theirs


def test_defaults_are_generates(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert dict(spec.defaults) == {
        "block_length": 128,
        "steps": 128,
        "temperature": 1.0,
        "sampler": "ancestral",
        "noise_schedule": "cosine",
        "tokens_per_step": 1,
        "max_tokens": 128,
    }
    assert spec.mask_token_id == fixture.MASK and spec.eos_token_ids == (fixture.EOS,)
    assert spec.max_position_embeddings == fixture.CONTEXT


@pytest.mark.slow
def test_a_noise_token_the_noise_cannot_hold_draws_from_the_marginal():
    """The mask id drawn into a uniform-noise canvas (upstream's generate raises at its
    multinomial): the ancestral step's weights are q_s, finite."""
    import mlx_dllm_models.decoding.gidd as rules

    x_hat = mx.softmax(mx.array(np.random.default_rng(0).normal(size=(1, 2, 8))), axis=-1)
    x_hat = x_hat * (mx.arange(8) != fixture.MASK)  # the mask id's logit is -inf
    log_snrs = rules.log_snr_schedule(4, "cosine", -9.0, 9.0)
    z = mx.array([[fixture.MASK, 5]])
    w = rules.ancestral_probs(z, x_hat, (log_snrs[3], log_snrs[2]), fixture.UNIFORM, fixture.MASK)
    assert mx.isfinite(w).all().item() and mx.all(w >= 0).item()
    alpha = mx.sigmoid(log_snrs[2])
    pi = rules.noise_mix(log_snrs[2], fixture.UNIFORM, 8, fixture.MASK)
    assert_close(w[0, 0], alpha * x_hat[0, 0] + (1 - alpha) * pi)


def test_an_adaptive_step_with_no_noise_left_changes_nothing():
    """A masked block whose masks are all filled (upstream: 0 / 0, and its top-k of NaN picks
    positions by torch's order): no position moves, so the README's 256 steps of a 128 block
    leave the block as its first 128 steps wrote it; with a mask left, upstream's top-k."""
    import mlx_dllm_models.decoding.gidd as rules

    logits = mx.array(np.random.default_rng(1).normal(size=(1, 4, 8)).astype(np.float32))
    z = mx.array([[5, 6, 7, 4]])  # no mask left
    picked = rules.adaptive_positions(z, logits, mx.array(2.0), fixture.MASKED, fixture.MASK, 2)
    assert not picked.any().item()
    with_mask = mx.array([[5, fixture.MASK, 7, 4]])
    picked = rules.adaptive_positions(
        with_mask, logits, mx.array(2.0), fixture.MASKED, fixture.MASK, 2
    )
    # The mask, and (upstream's top-k of two) a position of score 0, which holds its argmax.
    assert picked[0, 1].item() and picked.sum().item() == 2


class AppendsEos:
    """A tokenizer that ends every encoding with the EOS, as GIDD's does (the README's call cuts
    it off: `input_ids[:, :-1]`)."""

    bos_token = None

    def encode(self, text, add_special_tokens=True):
        return [fixture.BOS] + list(text.encode()) + [fixture.EOS] * add_special_tokens


def test_a_text_prompt_loses_the_eos_its_tokenizer_appends(loaded):
    model, _ = loaded
    request = prepare(model, AppendsEos(), ["hi", [0, 104, 105, 1]], {})
    assert request.ids == [[fixture.BOS, 104, 105], [0, 104, 105, 1]]  # given ids stay as given


def test_batch_rows_equal_single_runs(loaded):
    model, tok = loaded
    prompts = [random_prompt(5, 1), random_prompt(5, 2), random_prompt(7, 3)]
    batch_equal_to_single_runs(
        model, tok, prompts, block_length=8, steps=8, max_tokens=16, temperature=1.0
    )


def test_plain_mlx_lm_load_and_one_rank(ckpt, loaded):
    model, _ = loaded
    plain, _ = load_fixture(ckpt)
    ids = mx.array([random_prompt(9, 4)])
    np.testing.assert_allclose(np.array(plain(ids)), np.array(model(ids)), atol=1e-5)
    with pytest.raises(SettingsError, match="cannot split the checkpoint over 3 ranks"):
        model.shard(Ranks(3))
    model.shard(mx.distributed.init())
    np.testing.assert_allclose(np.array(plain(ids)), np.array(model(ids)), atol=1e-5)
