"""Nemotron-Labs-Diffusion decoding: AR-seeded blocks over a causal KV prefix (diffusion mode) and
lossless self-speculation.

Diffusion mode at temperature 0 is token-identical to an independent transcription of the HF
reference `generate` (tests/reference/nemotron_reference.py) and to mlx-vlm's own diffusion
generate; the KV cache is token-identical to full recompute. Self-speculation is token-identical to
greedy AR decoding with mlx-lm.
"""

import dataclasses
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures import nemotron as fx
from helpers import checkpoint_fixtures, load_fixture, run_cli, spy_forwards
from mlx_dllm_models import batch_generate_diffusion, stream_generate_diffusion
from mlx_dllm_models.engine import BlockEvent, make_decoder
from mlx_dllm_models.engine.self_spec import speculative_accept
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.settings import SettingsError, resolve_settings
from reference.nemotron_reference import VlmForward, hf_generate

ROOT = Path(__file__).resolve().parents[1]
L = fx.BLOCK_SIZE


PROMPTS = fx.prompts(4, seed=1)


checkpoint, loaded = checkpoint_fixtures(
    "nemotron", fx.build, name="checkpoint", loader=load_fixture
)


@pytest.fixture(scope="module")
def vlm(checkpoint):
    return fx.mlx_vlm_model(checkpoint)


def _ours(model, tok, prompt, **kw):
    out, responses = [], []
    for r in stream_generate_diffusion(model, tok, prompt, **kw):
        out.extend(r.tokens)
        responses.append(r)
    return out, responses


def _cut(tokens):
    tokens = [int(t) for t in tokens]
    cut = next((i for i, t in enumerate(tokens) if t == fx.EOS), None)
    return tokens if cut is None else tokens[:cut]


# ------------------------------------------------------------------------------ diffusion mode


@pytest.mark.parametrize("threshold", [None, 0.9, 0.6])
def test_diffusion_matches_hf_reference_generate(loaded, vlm, threshold):
    model, tok = loaded
    sampler = (
        dict(sampler="quota")
        if threshold is None
        else dict(sampler="threshold", threshold=threshold)
    )
    several = []
    for prompt in PROMPTS:
        x, _ = hf_generate(
            VlmForward(vlm), [prompt], 3 * L, L, fx.MASK, fx.EOS, threshold=threshold
        )
        assert fx.MASK not in x[0].tolist()  # (the reference may commit a mask id; ours never does)
        got, responses = _ours(model, tok, prompt, max_tokens=3 * L, **sampler)
        assert got == _cut(x[0, len(prompt) :])
        several.append(responses[-1].tokens_per_forward)
    if threshold is not None and threshold < 0.9:
        assert max(several) > 1.5, "fixture not confident: threshold never beats one per step"


@pytest.mark.parametrize(
    "max_tokens, steps, threshold", [(3 * L, L, None), (20, L, 0.9), (20, L // 2, None)]
)
def test_diffusion_matches_mlx_vlm_generate(loaded, vlm, max_tokens, steps, threshold):
    """mlx-vlm's native sampler: one token per step (threshold=None) or threshold + best one. It
    reads no block_size, so block_length is passed; with threshold it force-completes a block at its
    last step, which never comes into play when steps == block_length."""
    model, tok = loaded
    sampler = (
        dict(sampler="quota")
        if threshold is None
        else dict(sampler="threshold", threshold=threshold)
    )
    for prompt in PROMPTS:
        want = vlm.language_model.generate(
            mx.array([prompt]),
            block_length=L,
            steps=steps,
            gen_length=max_tokens,
            threshold=threshold,
            sampler="native",
        )
        got, _ = _ours(model, tok, prompt, max_tokens=max_tokens, steps=steps, **sampler)
        assert got == _cut(want[0].tolist())


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(sampler="threshold", threshold=0.7),
        dict(sampler="factor", factor=1.0),
        dict(sampler="entropy", entropy_bound=0.5),
        dict(block_length=5, steps=3),
        dict(temperature=1.0, seed=3),
        dict(temperature=0.7, top_k=20, seed=4, sampler="threshold", threshold=0.8),
    ],
)
def test_prefix_cache_equals_full_recompute(loaded, kw):
    model, tok = loaded
    for prompt in PROMPTS[:2]:
        cached, _ = _ours(model, tok, prompt, max_tokens=19, **kw)
        assert cached == _ours(model, tok, prompt, max_tokens=19, cache="none", **kw)[0]
        assert cached == _ours(model, tok, prompt, max_tokens=19, cache="prefix", **kw)[0]


@pytest.mark.parametrize("cache", ["auto", "none"])
def test_left_padded_batch_equals_one_by_one(loaded, cache):
    model, tok = loaded
    prompts = fx.prompts(3, seed=7)
    kw = dict(max_tokens=20, cache=cache, sampler="threshold", threshold=0.8)
    batch = batch_generate_diffusion(model, tok, prompts, **kw)
    assert len({len(p) for p in prompts}) > 1
    assert batch.tokens == [_ours(model, tok, p, **kw)[0] for p in prompts]


def test_forwards_of_the_cache(loaded):
    """The checkpoint's block_size is the default block; the prompt is encoded once, each denoising
    step runs over the block only, the finished block gets one causal forward, the last none."""
    model, tok = loaded
    seen = []
    prompt = PROMPTS[0]
    with spy_forwards(model, lambda inputs, *_: seen.append(inputs.shape[1])):
        _, responses = _ours(model, tok, prompt, max_tokens=3 * L, sampler="quota")
    per_block = [L] * (L - 1)  # one token per step; position 0 is the AR seed
    assert seen == [len(prompt)] + per_block + [L] + per_block + [L] + per_block
    assert responses[-1].nfe == len(seen)


# --------------------------------------------------------------------------- self-speculation


@pytest.mark.parametrize("cache", ["auto", "none"])
@pytest.mark.parametrize("max_tokens", [1, 7, 30])
def test_self_spec_equals_greedy_ar(loaded, cache, max_tokens):
    model, tok = loaded
    for prompt in fx.prompts(3, seed=max_tokens):
        got, responses = _ours(
            model, tok, prompt, max_tokens=max_tokens, mode="self_spec", cache=cache
        )
        assert got == fx.ar_greedy(model, prompt, max_tokens)
        assert responses[-1].finish_reason in ("stop", "length")
        # Every forward yields at least one token, as AR decoding does.
        assert responses[-1].tokens_per_forward >= 1 or responses[-1].finish_reason == "stop"


class OracleDrafts:
    """The fixture's model, except that at mask inputs (the draft window) it predicts the true
    greedy continuation, `truth[column]`, but a wrong token at the columns in `wrong`. An untrained
    model's drafts almost never agree with its AR head; this one's agree in runs, so acceptance,
    rejection and tokens per forward can be checked while verification stays the real model's."""

    def __init__(self, model, truth, wrong):
        self.model, self.layers, self.diffusion_spec = model, model.layers, model.diffusion_spec
        target = np.array(truth)
        target[list(wrong)] = (target[list(wrong)] + 1) % fx.VOCAB
        self.target = mx.array(target)

    def __call__(self, inputs, cache=None, mask=None, head_span=None):
        logits = self.model(inputs, cache=cache, mask=mask, head_span=head_span)
        lo = head_span[0] if head_span is not None else 0
        first = (0 if cache is None else int(cache[0].offset)) + lo
        cols = mx.minimum(mx.arange(first, first + logits.shape[1]), self.target.shape[0] - 1)
        oracle = 20.0 * (mx.arange(fx.VOCAB)[None, :] == self.target[cols][:, None])
        drafting = (inputs[:, lo : lo + logits.shape[1]] == fx.MASK)[..., None]
        return mx.where(drafting, oracle[None], logits)


@pytest.mark.parametrize("cache", ["auto", "none"])
def test_self_spec_accepts_agreeing_drafts(loaded, cache):
    model, tok = loaded
    prompt, n = PROMPTS[2], 40
    ar = fx.ar_greedy(model, prompt, n)
    assert len(ar) == n
    truth = prompt + ar + [0] * 64
    wrong = range(len(prompt) + 5, len(truth), 11)
    oracle = OracleDrafts(model, truth, wrong)
    kw = dict(max_tokens=n, mode="self_spec", cache=cache)
    s, ids, decoder = stream_events(model, tok, [prompt], **kw)
    decoder.model = oracle
    got = [t for e in decoder.run(ids) for t in e.tokens[0]]
    assert got == ar
    assert 0 < decoder.accepted < decoder.drafted, "no partial acceptance exercised"
    assert n / decoder.nfe > 2, f"{n} tokens in {decoder.nfe} forwards"
    # The same drafts, all wrong: one token per forward, and still the AR output.
    s, ids, decoder = stream_events(model, tok, [prompt], **kw)
    decoder.model = OracleDrafts(model, truth, range(len(truth)))
    assert [t for e in decoder.run(ids) for t in e.tokens[0]] == ar
    assert decoder.accepted == 0 and decoder.nfe == n


def test_self_spec_streams_chunks_and_batches(loaded):
    model, tok = loaded
    prompts = fx.prompts(3, seed=11)
    got, responses = _ours(model, tok, prompts[0], max_tokens=12, mode="self_spec")
    assert len(responses) > 1
    assert all(r.finish_reason is None for r in responses[:-1])
    batch = batch_generate_diffusion(model, tok, prompts, max_tokens=12, mode="self_spec")
    assert batch.tokens == [fx.ar_greedy(model, p, 12) for p in prompts]


def test_self_spec_sampling_is_seeded_and_cache_exact(loaded):
    model, tok = loaded
    kw = dict(max_tokens=16, mode="self_spec", temperature=0.8, seed=5)
    a, _ = _ours(model, tok, PROMPTS[0], **kw)
    assert a == _ours(model, tok, PROMPTS[0], **kw)[0]
    assert a == _ours(model, tok, PROMPTS[0], cache="none", **kw)[0]
    assert a != _ours(model, tok, PROMPTS[0], **{**kw, "seed": 6})[0]
    assert fx.MASK not in a


@pytest.mark.slow
def test_speculative_accept_keeps_the_target_distribution():
    """Speculative sampling: whatever the drafts' distribution q, each returned token follows p."""
    p = mx.array([[0.6, 0.3, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = mx.array([[0.1, 0.2, 0.3, 0.4]])
    rng = np.random.default_rng(0)
    trials = 3000
    counts = np.zeros(4)
    for i in range(trials):
        draft = int(rng.choice(4, p=np.array(q[0])))
        counts[speculative_accept(p, q, [draft], mx.random.key(i))[0]] += 1
    assert np.abs(counts / trials - np.array(p[0])).max() < 0.04, counts / trials


# ------------------------------------------------------------------------- settings and CLI


def test_bad_settings_raise_clear_errors(loaded):
    model, tok = loaded
    with pytest.raises(SettingsError, match="unknown mode 'fast'.*diffusion, self_spec"):
        _ours(model, tok, "hi", mode="fast")
    for bad in (dict(steps=4), dict(sampler="threshold"), dict(threshold=0.5)):
        with pytest.raises(SettingsError, match="only acts with mode='diffusion'"):
            _ours(model, tok, "hi", mode="self_spec", **bad)


def _cli(checkpoint, *extra):
    args = ["generate", "--model", str(checkpoint), "--prompt", "hi", "--max-tokens", "16"]
    return run_cli(*args, "--no-live", *extra)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "self_spec"])
def test_cli_generates(checkpoint, mode):
    out = _cli(checkpoint, *(["--mode", mode] if mode else []))
    assert out.returncode == 0, out.stderr
    assert "tokens/forward" in out.stdout


@pytest.mark.slow
def test_cli_rejects_an_unknown_mode(checkpoint):
    out = _cli(checkpoint, "--mode", "fast")
    assert out.returncode != 0 and "unknown mode 'fast'" in out.stderr


def test_a_block_stops_at_an_eos_with_no_mask_before_it(loaded, vlm):
    """As the HF generate: a block's steps end once it holds an EOS with no mask before it (the
    positions after it are never returned). The fixture's own EOS is rare, so a token it does
    produce plays the EOS on both sides; tokens and forwards equal the reference's."""
    model, tok = loaded
    spec = model.diffusion_spec
    assert spec.eos_ends_block
    prompt = PROMPTS[1]
    plain, _ = _ours(model, tok, prompt, max_tokens=3 * L)
    stop_id = Counter(plain[1:L]).most_common(1)[0][0]  # present in the first block
    settings = resolve_settings(spec, {"max_tokens": 3 * L}, {})
    # The diffusion-mode default: confidence-thresholded unmasking at 0.9 (see the model's spec).
    assert (settings.sampler, settings.threshold) == ("threshold", 0.9)
    x, ref_nfe = hf_generate(
        VlmForward(vlm), [prompt], 3 * L, L, fx.MASK, stop_id, threshold=settings.threshold
    )
    want = [int(t) for t in x[0, len(prompt) :]]
    want = want[: want.index(stop_id)]

    def decode():
        decoder = make_decoder(model, settings, [stop_id])
        got, stopped = [], False
        for event in decoder.run([prompt]):
            if isinstance(event, BlockEvent):
                got.extend(event.tokens[0])
                stopped = stopped or event.eos[0]
        assert stopped
        return got, decoder.nfe

    got, nfe = decode()
    assert got == want
    # Ours counts the prompt's forward; the reference, a causal forward after the last block.
    assert nfe == ref_nfe
    model.diffusion_spec = dataclasses.replace(spec, eos_ends_block=False)
    try:
        finishing = decode()
    finally:
        model.diffusion_spec = spec
    assert finishing[0] == got and finishing[1] > nfe, "the stop saved no forward: pick another id"
