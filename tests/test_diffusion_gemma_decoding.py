"""DiffusionGemma canvas decoding: step-by-step parity with transformers' own
`DiffusionGemmaForBlockDiffusion.generate`, settings, streaming, batching.

The two implementations draw from different random generators, so both are fed one pre-drawn
sequence: the initial canvas and every re-noising draw (transformers' `torch.randint`), and one
uniform number per position for the categorical draw (transformers' `torch.multinomial`, replaced
by the inverse CDF that the engine uses). Everything else is each side's own code.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_dllm_models.engine.canvas as canvas_mod
from diffusion_gemma_checks import (
    C,
    Draws,
    assert_same_steps,
    gemma_fixtures,
    run_engine,
    run_transformers,
    until_eos,
)
from fixtures import diffusion_gemma as fx
from mlx_dllm_models import stream_generate_diffusion
from mlx_dllm_models.decoding import linear_temperature, stable_and_confident
from mlx_dllm_models.engine import BlockEvent, make_decoder
from mlx_dllm_models.engine.canvas import CanvasDecoder, CanvasStepEvent
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.models import diffusion_gemma
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import SettingsError, resolve_settings

PROMPT = [fx.BOS, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108]


checkpoint, dg, reference, eos_ids = gemma_fixtures()


# Each case: (settings passed to both sides, EOS ids, seed of the shared draws).
CASES = {
    # The checkpoint's generation_config: 48 steps, stability 1, confidence 0.005; one of its EOS
    # ids ends the output inside the second canvas.
    "generation_config": ({}, fx.EOS_IDS, 11),
    # Two canvases (the second one conditioned on the encoded first), each stopping early on the
    # confidence rule.
    "two_canvases_early_stop": (
        dict(max_denoising_steps=16, stability_threshold=0, confidence_threshold=0.2),
        [fx.VOCAB - 1],
        3,
    ),
}


@pytest.fixture(scope="module")
def parity_runs(dg, reference):
    model = dg[0]
    out = {}
    mp = pytest.MonkeyPatch()
    for name, (settings, eos, seed) in CASES.items():
        steps = settings.get("max_denoising_steps", 48)
        draws = Draws(seed, 2, steps)
        ours = run_engine(model, PROMPT, draws, eos, **settings)
        theirs = run_transformers(reference, PROMPT, draws, eos, mp, **settings)
        out[name] = (draws, ours, theirs)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_generation_matches_transformers_step_by_step(parity_runs, case):
    _, (rec, tokens, blocks), (ref_rec, ref_tokens) = parity_runs[case]
    assert_same_steps(rec, ref_rec)
    eos = CASES[case][1]
    assert tokens == until_eos(ref_tokens, eos)
    if case == "generation_config":
        assert blocks[-1].eos[0] and C < len(tokens) < 2 * C, "the case no longer ends at an EOS"
    else:
        assert len(blocks) == 2 and len(tokens) == 2 * C
        assert len(rec["input"]) < 2 * 16, "no canvas stopped early"
    # Logits too: the temperature-scaled logits the samplers read.
    pairs = zip(rec["processed"], ref_rec["processed"])
    assert max(np.abs(a - b).max() / np.abs(b).max() for a, b in pairs) < 1e-4


def _rising_temperature(mp, model):
    rising = lambda r, n, lo, hi: linear_temperature(n + 1 - r, n, lo, hi)  # noqa: E731
    mp.setattr(canvas_mod, "linear_temperature", rising)


def _no_self_conditioning(mp, model):
    real = type(model).decode
    mp.setattr(type(model), "decode", lambda m, x, cache, sc, **k: real(m, x, cache, None, **k))


def _no_renoise(mp, model):
    mp.setattr(canvas_mod, "renoise", lambda canvas, keep, noise: canvas)


def _entropy_without_temperature(mp, model):
    real = canvas_mod.canvas_stats
    mp.setattr(
        canvas_mod,
        "canvas_stats",
        lambda logits, t, u: real(logits, t, u)._replace(entropy=real(logits, 1.0, u).entropy),
    )


MISTAKES = {
    "temperature_rising": _rising_temperature,
    "no_self_conditioning": _no_self_conditioning,
    "no_renoise": _no_renoise,
    "entropy_without_temperature": _entropy_without_temperature,
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_parity_check_catches_mistakes(dg, parity_runs, mistake, monkeypatch):
    draws, _, (ref_rec, ref_tokens) = parity_runs["two_canvases_early_stop"]
    settings, eos, _ = CASES["two_canvases_early_stop"]
    model = dg[0]
    MISTAKES[mistake](monkeypatch, model)
    rec, tokens, _ = run_engine(model, PROMPT, draws, eos, **settings)
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        assert_same_steps(rec, ref_rec)


# ------------------------------------------------------------------------------- pure rules


def test_stopping_rule_matches_transformers():
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        StableAndConfidentStoppingCriteria,
    )

    rng = np.random.default_rng(0)
    for k in (0, 1, 2):
        ref = StableAndConfidentStoppingCriteria(stability_threshold=k, confidence_threshold=0.7)
        history = None
        base = rng.integers(0, 5, size=(3, 6))
        for step in range(6):
            argmax = base.copy()
            argmax[step % 3, step % 6] += step % 2  # some rows change, some stay put
            logits = rng.standard_normal((3, 6, 8)).astype(np.float32) * (3 + step)
            want = ref(torch.tensor(argmax), torch.tensor(logits)).numpy()
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            entropy = mx.array(-(p * np.log(p)).sum(-1))
            got, history = stable_and_confident(history, mx.array(argmax), entropy, k, 0.7)
            assert np.array_equal(np.array(got), want), (k, step)


def test_temperature_schedule_matches_transformers():
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        LinearTemperatureScheduleLogitsProcessor,
    )

    ref = LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=48)
    ones = torch.ones(1)
    for remaining in (48, 47, 24, 1):
        t = float(1 / ref(None, ones, cur_step=remaining))
        assert abs(linear_temperature(remaining, 48, 0.4, 0.8) - t) < 1e-6


# ----------------------------------------------------------------------------------- settings


def test_defaults_come_from_generation_config(dg):
    model, proc = dg
    s, _, decoder = stream_events(model, proc, [PROMPT])
    assert isinstance(decoder, CanvasDecoder)
    gen = fx.GENERATION_CONFIG
    assert s.sampler == "entropy"
    assert s.max_tokens == gen["max_new_tokens"]
    assert s.entropy_bound == gen["sampler_config"]["entropy_bound"]
    names = ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold")
    for name in names:
        assert getattr(s, name) == gen[name], name
    assert s.min_canvas_length == s.max_canvas_length == C

    # A checkpoint's own values, the nested one included, win over the family's.
    saved = model.generation_config
    nested = {"entropy_bound": 0.5}
    model.generation_config = dict(saved, t_min=0.2, max_new_tokens=40, sampler_config=nested)
    try:
        s, _, _ = stream_events(model, proc, [PROMPT])
    finally:
        model.generation_config = saved
    assert (s.t_min, s.max_tokens, s.entropy_bound) == (0.2, 40, 0.5)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(block_length=8), "block_length does not apply to the diffusion_gemma family"),
        (dict(steps=8), "set max_denoising_steps"),
        (dict(temperature=-1), "temperature must be a number >= 0"),
        (dict(top_p=0.9), "top_p does not apply"),
        (dict(top_k=5), "top_k does not apply"),
        (dict(factor=1.0), "factor does not apply"),
        (dict(sampler="quota"), "unknown sampler 'quota'"),
        (dict(threshold=0.5), "threshold only acts with sampler='threshold'"),
        (dict(sampler="threshold", entropy_bound=0.5), "entropy_bound only acts with sampler="),
        (dict(max_denoising_steps=0), "max_denoising_steps must be an integer >= 1"),
        (dict(t_min=-1), "t_min must be a number >= 0"),
        (dict(t_min=0.9, t_max=0.5), "t_max (0.5) is the first step's temperature"),
        (dict(stability_threshold=-1), "stability_threshold must be an integer >= 0"),
        (dict(confidence_threshold="x"), "confidence_threshold must be a number"),
        (dict(min_canvas_length=0), "min_canvas_length must be an integer >= 1"),
        (dict(min_canvas_length=9, max_canvas_length=8), "min_canvas_length (9) exceeds"),
        (dict(canvas_length=8), "unknown setting(s) canvas_length"),
    ],
)
def test_bad_settings_are_clear_errors(dg, settings, message):
    model, proc = dg
    with pytest.raises(SettingsError) as e:
        stream_events(model, proc, [PROMPT], **settings)
    assert message in str(e.value)


# --------------------------------------------------------------------------------- behaviour


def _spy_decode(model, monkeypatch, method="decode"):
    """The lengths of the sequences `model.<method>` is called on, from now on."""
    lengths = []
    real = getattr(model, method)

    def spied(x, *a, **k):
        lengths.append(x.shape[1])
        return real(x, *a, **k)

    monkeypatch.setattr(model, method, spied, raising=False)
    return lengths


def _generate(model, tok, prompt=PROMPT, **kw):
    tokens, responses = [], []
    for r in stream_generate_diffusion(model, tok, prompt, **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


@pytest.mark.parametrize(
    "max_tokens, canvases",
    [(5, [5]), (2, [3]), (2 * C + 7, [C, C, 7])],
)
def test_short_answers_get_a_short_canvas(dg, eos_ids, monkeypatch, max_tokens, canvases):
    model, proc = dg
    lengths = _spy_decode(model, monkeypatch)
    tokens, responses = _generate(
        model, proc, max_tokens=max_tokens, min_canvas_length=3, max_denoising_steps=2, seed=1
    )
    assert [len(r.tokens) for r in responses] == [min(c, max_tokens) for c in canvases]
    assert len(tokens) == max_tokens and responses[-1].finish_reason == "length"
    assert lengths == [c for c in canvases for _ in range(2)]


@pytest.mark.parametrize("max_tokens", [5, C + 3])
def test_every_canvas_is_the_trained_length_by_default(dg, eos_ids, monkeypatch, max_tokens):
    """As transformers' generate: ceil(max_tokens / canvas_length) canvases of the trained length
    each, the output cut at max_tokens afterwards."""
    model, proc = dg
    lengths = _spy_decode(model, monkeypatch)
    tokens, responses = _generate(model, proc, max_tokens=max_tokens, max_denoising_steps=2, seed=1)
    assert len(tokens) == max_tokens and responses[-1].finish_reason == "length"
    assert lengths and set(lengths) == {C}
    assert len(lengths) == 2 * -(-max_tokens // C)


def test_a_short_request_on_a_256_canvas_checkpoint_denoises_all_256(checkpoint):
    """The real checkpoints' canvas (256, above the old floor of 64): a 5-token request still
    denoises 256 positions by default; min_canvas_length opts into a shorter last canvas."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["canvas_length"] = 256
    model = diffusion_gemma.Model(diffusion_gemma.ModelArgs.from_dict(cfg))  # lazy, never run
    spec = model.diffusion_spec
    s = resolve_settings(spec, {"max_tokens": 5}, {})
    assert s.min_canvas_length == s.max_canvas_length == 256
    assert make_decoder(model, s, ()).canvas_length(5) == 256
    s = resolve_settings(spec, {"max_tokens": 5, "min_canvas_length": 64}, {})
    assert make_decoder(model, s, ()).canvas_length(5) == 64


def test_stream_is_live_one_response_per_canvas(dg, eos_ids, monkeypatch):
    """The first canvas is delivered before any forward of the second one runs, and before the
    first canvas is even encoded."""
    model, proc = dg
    lengths = _spy_decode(model, monkeypatch)
    encoded = _spy_decode(model, monkeypatch, "encode")
    stream = stream_generate_diffusion(model, proc, PROMPT, max_tokens=3 * C, max_denoising_steps=4)
    first = next(stream)
    assert len(first.tokens) == C and first.finish_reason is None and first.nfe == 4
    assert len(lengths) == 4 and encoded == [len(PROMPT)]
    second = next(stream)
    assert second.nfe == 8 and encoded == [len(PROMPT), C]
    rest = list(stream)
    assert len(rest) == 1 and rest[0].finish_reason == "length" and rest[0].nfe == 12


def test_eos_ends_the_output_and_is_not_returned(dg, eos_ids):
    model, proc = dg
    full, _ = _generate(model, proc, max_tokens=2 * C, max_denoising_steps=3)
    first = next(i for i in range(C, 2 * C) if full[i] not in full[:i])  # new in the 2nd canvas
    eos_ids([full[first]])
    tokens, responses = _generate(model, proc, max_tokens=2 * C, max_denoising_steps=3)
    assert tokens == full[:first]
    assert responses[-1].finish_reason == "stop" and len(responses) == 2


def test_seeded_runs_are_reproducible_and_the_seed_matters(dg):
    model, proc = dg
    a, _ = _generate(model, proc, max_tokens=C, max_denoising_steps=4, seed=5)
    b, _ = _generate(model, proc, max_tokens=C, max_denoising_steps=4, seed=5)
    c, _ = _generate(model, proc, max_tokens=C, max_denoising_steps=4, seed=6)
    assert a == b and a != c


def test_threshold_sampler_reveals_for_good_and_finishes_the_canvas(dg, monkeypatch):
    model, proc = dg

    def steps(threshold, max_denoising_steps):
        """The canvas step events of one threshold-sampler run over a canvas of C."""
        settings = dict(threshold=threshold, max_denoising_steps=max_denoising_steps)
        _, ids, decoder = stream_events(
            model, proc, [PROMPT], sampler="threshold", max_tokens=C, **settings
        )
        return [e for e in decoder.run(ids) if isinstance(e, CanvasStepEvent)]

    pending = [np.array(e.pending) for e in steps(0.9, 48)]
    assert not pending[-1].any(), "the canvas ended with positions never accepted"
    for before, after in zip(pending, pending[1:]):
        assert not (after & ~before).any(), "an accepted position went back to pending"
    assert 1 < len(pending) < 48, "threshold 0.9 should accept several positions a step"
    # Threshold 1.0: one position a step (the most confident) until the last step takes the rest.
    pending = [int(np.array(e.pending).sum()) for e in steps(1.0, 6)]
    assert pending == [C - 1, C - 2, C - 3, C - 4, C - 5, 0]


def test_batch_equals_one_by_one(dg):
    """Left-padded rows of different lengths decode as they would alone, each stopping at its own
    EOS and leaving the batch."""
    model, proc = dg
    prompts = [PROMPT, [fx.BOS, 50, 51], [fx.BOS] + [60] * 14]
    settings = dict(max_tokens=3 * C, max_denoising_steps=3, seed=2)
    spec = model.diffusion_spec
    s = resolve_settings(spec, settings, checkpoint_settings(model, spec))
    events = make_decoder(model, s, []).run([prompts[0]])
    probe = [t for e in events if isinstance(e, BlockEvent) for t in e.tokens[0]]
    eos = [probe[5]]  # row 0 stops in its first canvas; the others decide for themselves

    def solo(prompt):
        decoder = make_decoder(model, s, eos)
        toks, hit = [], False
        for e in decoder.run([prompt]):
            if isinstance(e, BlockEvent):
                toks += e.tokens[0]
                hit = hit or e.eos[0]
        return toks, hit

    alone = [solo(p) for p in prompts]
    batch = make_decoder(model, s, eos)
    got = [[] for _ in prompts]
    hits = [False] * len(prompts)
    for e in batch.run(prompts):
        if isinstance(e, BlockEvent):
            for row, toks, hit in zip(e.rows, e.tokens, e.eos):
                got[row] += toks
                hits[row] = hits[row] or hit
    assert got == [t for t, _ in alone]
    assert hits == [h for _, h in alone]
    assert hits[0] and len(got[0]) == 5
    assert any(len(t) > C for t in got[1:]), "no row outlived the first one"


def test_live_view_shades_pending_positions(dg):
    from mlx_dllm_models.cli_common import render

    _, proc = dg
    canvas = [104, 105, 33, fx.EOS, 65]
    assert render(proc, canvas, None, {fx.EOS}) == "hi!"
    assert render(proc, canvas, None, {fx.EOS}, pending=[0, 1, 0, 0, 0]) == "h░!"


def test_spec_names_the_canvas_loop(dg):
    spec = dg[0].diffusion_spec
    assert spec.decoder == "canvas" and spec.vocab_size == fx.VOCAB
    for name, value in dict(block_length=8, steps=4, top_p=0.9, top_k=5).items():
        with pytest.raises(SettingsError, match=f"{name} does not apply to the diffusion_gemma"):
            resolve_settings(spec, {name: value})
    # temperature scales its t_max -> t_min schedule (tests/test_setting_surfaces.py).
    plain, cooler = resolve_settings(spec, {}), resolve_settings(spec, {"temperature": 0.5})
    assert (cooler.t_min, cooler.t_max) == (plain.t_min * 0.5, plain.t_max * 0.5)
