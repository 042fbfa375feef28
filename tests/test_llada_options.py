"""The options of LLaDA's generate.py (ML-GSAI/LLaDA): classifier-free guidance (`cfg_scale`),
remasking="random" (sampler "random"), `logits_eos_inf` and `confidence_eos_eot_inf`; token parity
at temperature 0 with the transcription in reference/llada_torch.py, run on our forward (the
forward's numerics have their own parity tests), and their errors."""

import functools

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.llada import CHECKPOINTS, LLADA_TOKENS
from helpers import cut_at_eos, load_fixture, stream_tokens, torch_logits_fn
from mlx_dllm_models import batch_generate_diffusion
from mlx_dllm_models.settings import SettingsError
from reference.llada_torch import llada_generate

PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [100, 7, 7, 200, 13, 9, 9]]


# Guidance sharpens the logits by (cfg_scale + 1): with the fixtures' heads, float32 confidences
# would saturate at 1.0 and tie, where the reference's float64 ones do not. A softer head keeps
# them apart (the engine breaks ties by position, torch.topk in no specified order).
SOFT_HEAD = 0.4


def _soften(model):
    model.lm_head.weight = model.lm_head.weight * SOFT_HEAD
    return model


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def llada(request, tmp_path_factory):
    path = CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt")
    model, tok = load_fixture(path)
    return path, _soften(model), tok


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = CHECKPOINTS["llada"](tmp_path_factory.mktemp("llada_dense") / "ckpt")
    model, tok = load_fixture(path)
    return _soften(model), tok


def _reference(model, prompts, gen, block, steps_per_block, **kw):
    spec = model.diffusion_spec
    x = llada_generate(
        torch_logits_fn(model),
        torch.tensor(prompts),
        steps=steps_per_block * (gen // block),
        gen_length=gen,
        block_length=block,
        mask_id=spec.mask_token_id,
        **kw,
    )
    return [
        cut_at_eos(row[len(prompts[0]) : len(prompts[0]) + gen], set(spec.eos_token_ids))
        for row in x
    ]


@pytest.mark.slow
@pytest.mark.parametrize("cfg_scale", [0.5, 2.0])
def test_cfg_scale_matches_generate_py(llada, cfg_scale):
    _, model, tok = llada
    gen, block, steps = 16, 8, 4
    want = _reference(model, PROMPTS, gen, block, steps, cfg_scale=cfg_scale)
    plain = _reference(model, PROMPTS, gen, block, steps)
    assert want != plain, "guidance changes nothing on these prompts: the test could not fail"
    for prompt, w in zip(PROMPTS, want):
        got = stream_tokens(
            model, tok, prompt, max_tokens=gen, block_length=block, steps=steps, cfg_scale=cfg_scale
        )
        assert got == w
    # Both rows of a batch in one forward (the reference's batch of two, unpadded).
    batch = batch_generate_diffusion(
        model, tok, PROMPTS, max_tokens=gen, block_length=block, steps=steps, cfg_scale=cfg_scale
    )
    assert batch.tokens == want


@pytest.mark.parametrize("sampler", ["threshold", "entropy"])
def test_cfg_scale_with_padding_and_other_samplers_matches_one_by_one(dense, sampler):
    model, tok = dense
    prompts = [PROMPTS[0], [5, 6, 7]]
    kw = dict(max_tokens=8, block_length=8, cfg_scale=1.0, sampler=sampler)
    batch = batch_generate_diffusion(model, tok, prompts, **kw)
    assert batch.tokens == [stream_tokens(model, tok, p, **kw) for p in prompts]
    assert (
        batch.tokens
        != batch_generate_diffusion(model, tok, prompts, **{**kw, "cfg_scale": 0.0}).tokens
    )


def test_cfg_runs_both_rows_in_one_forward(dense):
    model, tok = dense
    seen = []
    real = type(model).__call__

    def spy(self, inputs, cache=None, mask=None, head_span=None):
        seen.append(inputs.shape[0])
        return real(self, inputs, cache=cache, mask=mask, head_span=head_span)

    type(model).__call__ = spy
    try:
        stream_tokens(model, tok, PROMPTS[0], max_tokens=8, block_length=8, cfg_scale=1.0)
    finally:
        type(model).__call__ = real
    assert seen and set(seen) == {2}


def test_random_remasking_matches_generate_py(dense):
    """The reference's `torch.rand` draws replayed from the engine's keys: per forward, the key
    splits into (key, k_stats, k_rule) and k_rule draws the block's uniforms."""
    model, tok = dense
    gen, block, seed = 16, 8, 3
    key = [mx.random.key(seed)]
    calls = []

    def rand(shape):
        key[0], _, k_rule = mx.random.split(key[0], 3)
        start = len(PROMPTS[0]) + (len(calls) // block) * block
        calls.append(start)
        u = torch.full(shape, -1.0, dtype=torch.float64)
        draw = np.array(mx.random.uniform(shape=(shape[0], block), key=k_rule))
        u[:, start : start + block] = torch.from_numpy(draw.astype(np.float64))
        return u

    want = _reference(model, PROMPTS[:1], gen, block, block, remasking="random", rand=rand)[0]
    assert len(calls) == gen  # one draw per step, every step commits one token (no skipped step)
    got = stream_tokens(
        model, tok, PROMPTS[0], max_tokens=gen, block_length=block, sampler="random", seed=seed
    )
    assert got == want
    assert got != stream_tokens(model, tok, PROMPTS[0], max_tokens=gen, block_length=block)
    other = stream_tokens(
        model, tok, PROMPTS[0], max_tokens=gen, block_length=block, sampler="random", seed=4
    )
    assert other != got  # seeded


@pytest.fixture(scope="module")
def eos_heavy(tmp_path_factory):
    """The dense fixture with the EOS and EoT head rows made copies of the most proposed token's
    row (slightly scaled up), so that both are proposed and the options have something to act on."""
    path = CHECKPOINTS["llada"](tmp_path_factory.mktemp("llada_eos") / "ckpt")
    model, tok = load_fixture(path)
    logits = model(mx.array([PROMPTS[0] + [model.diffusion_spec.mask_token_id] * 16]))
    top = np.bincount(np.array(mx.argmax(logits, axis=-1)).ravel()).argmax()
    w = np.array(model.lm_head.weight)
    eos, eot = LLADA_TOKENS["<|endoftext|>"], LLADA_TOKENS["<|eot_id|>"]
    w[eos] = w[top] * 1.05
    w[eot] = w[top] * 1.03
    model.lm_head.weight = mx.array(w)
    return model, tok, eos, eot


@pytest.mark.parametrize(
    "options",
    [
        {"logits_eos_inf": True},
        {"confidence_eos_eot_inf": True},
        {"logits_eos_inf": True, "confidence_eos_eot_inf": True},
    ],
    ids=["logits_eos_inf", "confidence_eos_eot_inf", "both"],
)
def test_eos_options_match_generate_py(eos_heavy, options):
    model, tok, eos, eot = eos_heavy
    gen, block, steps = 16, 16, 8
    ids = dict(eos_id=eos, eot_id=eot)
    spec = model.diffusion_spec
    # Compare whole canvases (no EOS cut): the options act on where EOS / EoT land.
    reference = functools.partial(
        llada_generate,
        torch_logits_fn(model),
        torch.tensor([PROMPTS[0]]),
        steps=steps,
        gen_length=gen,
        block_length=block,
        mask_id=spec.mask_token_id,
    )
    x = reference(**ids, **options)
    plain = reference()
    assert (x != plain).any(), "the option changes nothing here: the test could not fail"
    want = cut_at_eos(x[0, len(PROMPTS[0]) :], set(spec.eos_token_ids))
    got = stream_tokens(
        model, tok, PROMPTS[0], max_tokens=gen, block_length=block, steps=steps, **options
    )
    assert got == want
    if options.get("logits_eos_inf"):
        assert eos not in x[0]


def test_eot_id_comes_from_the_tokenizer(eos_heavy):
    model, tok, eos, eot = eos_heavy
    from mlx_dllm_models.request import eot_id
    from mlx_dllm_models.settings import resolve_settings

    s = resolve_settings(model.diffusion_spec, {"confidence_eos_eot_inf": True})
    assert eot_id(tok, model.diffusion_spec, s) == eot == 313  # the fixture's <|eot_id|>


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"cfg_scale": -1.0}, "cfg_scale must be"),
        ({"cfg_scale": float("inf")}, "cfg_scale must be"),
        ({"logits_eos_inf": 1}, "true or false"),
        ({"sampler": "low_confidence"}, "random"),
    ],
)
def test_bad_llada_options(dense, settings, words):
    model, tok = dense
    with pytest.raises(SettingsError, match=words):
        stream_tokens(model, tok, PROMPTS[0], max_tokens=4, **settings)


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    from fixtures.dream import build

    return load_fixture(build(tmp_path_factory.mktemp("dream") / "ckpt"))


@pytest.mark.parametrize(
    "settings", [{"cfg_scale": 1.0}, {"logits_eos_inf": True}, {"sampler": "random"}]
)
def test_llada_options_are_llada_only(dream, settings):
    model, tok = dream
    with pytest.raises(SettingsError, match="family only|random"):
        stream_tokens(model, tok, [5, 6, 7], max_tokens=4, **settings)


def test_cli_flags(dense):
    from mlx_dllm_models.cli import generate_parser

    args = generate_parser().parse_args(
        ["--cfg-scale", "1.5", "--logits-eos-inf", "true", "--confidence-eos-eot-inf", "no"]
    )
    assert (args.cfg_scale, args.logits_eos_inf, args.confidence_eos_eot_inf) == (1.5, True, False)


def test_cfg_scale_is_refused_by_a_backend_without_guidance(dense):
    """A backend runs guidance only if it says so (`guidance = True`): elsewhere cfg_scale is an
    error, never silently dropped."""
    from mlx_dllm_models.engine.contracts import Backend, DecoderInputs
    from mlx_dllm_models.engine.masked import MaskedBlockDecoder
    from mlx_dllm_models.settings import resolve_settings

    class NoGuidance(Backend):
        pass

    model, _ = dense
    s = resolve_settings(model.diffusion_spec, {"cfg_scale": 1.0})
    with pytest.raises(SettingsError, match="cfg_scale is not supported"):
        MaskedBlockDecoder(model, DecoderInputs(model.diffusion_spec, s), NoGuidance)


def _replayed_draws(seed, prompt_len, block, vocab, rows=1):
    """The engine's draws, step by step: per forward the key splits into (key, k_stats, k_rule);
    k_stats draws the Gumbel uniforms of the block's (rows, block, V) logits. Returns a
    `rand(shape)` for the reference that places them on the step's block (one block per
    `block` steps, one token per step)."""
    key, calls = [mx.random.key(seed)], []

    def rand(shape):
        key[0], k_stats, _ = mx.random.split(key[0], 3)
        start = prompt_len + (len(calls) // block) * block
        calls.append(start)
        u = np.full(shape, 0.5)
        draw = mx.random.uniform(low=1e-20, high=1.0, shape=(rows, block, vocab), key=k_stats)
        u[:, start : start + block] = np.array(draw)
        return u

    return rand, calls


@pytest.mark.parametrize(
    "options",
    [{"cfg_scale": 1.0}, {"confidence_eos_eot_inf": True}],
    ids=["cfg_scale", "confidence_eos_eot_inf"],
)
def test_options_at_temperature_match_generate_py_with_the_same_noise(eos_heavy, dense, options):
    """Above temperature 0, with the reference's Gumbel draws replayed from the engine's keys
    (confidence_eos_eot_inf then leaves EOS in the confidence: only EoT is taken out). Guidance
    runs on the softer head (float32 confidences would tie at 1.0 otherwise)."""
    model, tok, eos, eot = eos_heavy
    if "cfg_scale" in options:
        model, tok = dense
    gen = block = 8
    vocab = model.lm_head.weight.shape[0]
    rand, calls = _replayed_draws(7, len(PROMPTS[0]), block, vocab)
    x = llada_generate(
        torch_logits_fn(model),
        torch.tensor([PROMPTS[0]]),
        steps=gen,
        gen_length=gen,
        block_length=block,
        temperature=0.7,
        mask_id=model.diffusion_spec.mask_token_id,
        eos_id=eos,
        eot_id=eot,
        gumbel_rand=rand,
        **options,
    )
    assert len(calls) == gen
    want = cut_at_eos(x[0, len(PROMPTS[0]) :], set(model.diffusion_spec.eos_token_ids))
    got = stream_tokens(
        model,
        tok,
        PROMPTS[0],
        max_tokens=gen,
        block_length=block,
        temperature=0.7,
        seed=7,
        **options,
    )
    assert got == want
