"""MMaDA's text-to-image path against the torch transcription of the reference
(tests/reference/mmada_torch.py) on the tiny fixture: the prompt layout, the guided image-token
logits, the tokens and masking of every step with the same draws injected, the VQ decoder's
pixels and the encoder's codes; then the API (batch rows equal their single runs, streaming,
errors)."""

import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures.llada import build_llada
from fixtures.mmada import MMADA_TOKENS, NUM_VQ_TOKENS, TEXT_VOCAB, build_mmada, vq_arrays
from helpers import checkpoint_fixtures
from image_checks import run_on_draws
from mlx_dllm_models import load
from mlx_dllm_models.decoding.maskgit import cosine_mask_ratio, mask_lengths
from mlx_dllm_models.errors import SettingsError
from mlx_dllm_models.images import (
    batch_generate_image,
    decoder_for,
    generate_image,
    image_spec_of,
    resolve_vq_model,
    stream_batch,
    stream_generate_image,
    t2i_rows,
)
from mlx_dllm_models.models import magvitv2
from reference import mmada_torch as ref

PROMPTS = ["a red cat", "two green birds over the sea at dusk"]
IDS = {n: MMADA_TOKENS[n] for n in ("<|t2i|>", "<|soi|>", "<|eoi|>", "[iPAD]")}


ckpt, loaded = checkpoint_fixtures("mmada", build_mmada)


def numpy_draws(batch, n_tokens, seed=0):
    def draws(step):
        rng = np.random.default_rng([seed, step])
        return rng.random((batch, n_tokens), dtype=np.float32), rng.random(
            (batch, n_tokens), dtype=np.float32
        )

    return draws


def reference_run(ckpt, tok, prompts, *, guidance, steps, temperature, max_text_len, n_tokens):
    ids, mask = ref.t2i_gen_prompt(
        tok, prompts, n_tokens, max_text_len, IDS, MMADA_TOKENS["<|mdm_mask|>"]
    )
    uncond = ref.t2i_gen_prompt(
        tok, [""] * len(prompts), n_tokens, max_text_len, IDS, MMADA_TOKENS["<|mdm_mask|>"]
    )
    return ref.t2i_generate(
        ref.forward_with_bias(ckpt),
        ids,
        uncond[0] if guidance > 0 else None,
        mask,
        uncond[1] if guidance > 0 else None,
        temperature=temperature,
        timesteps=steps,
        guidance_scale=guidance,
        seq_len=n_tokens,
        resolution=max_text_len,
        offset=TEXT_VOCAB,
        codebook_size=64,
        mask_token_id=MMADA_TOKENS["<|mdm_mask|>"],
        draws=numpy_draws(len(prompts), n_tokens),
    )


def mlx_run(model, tok, prompts, *, guidance, steps, temperature, max_text_len, width=None):
    spec = replace(image_spec_of(model), max_text_len=max_text_len)
    vq = resolve_vq_model(tok, spec)
    size = dict(width=width, height=width)
    decoder, _, steps, guidance = decoder_for(
        model, tok, prompts, spec, vq, **size, steps=steps, guidance_scale=guidance
    )
    seen = []
    logits_of = decoder.logits

    def recording(scale):
        out = logits_of(scale)
        seen.append(np.array(out))
        return out

    decoder.logits = recording
    np_draws = numpy_draws(len(prompts), decoder.n_tokens)
    events = run_on_draws(
        decoder, np_draws, steps=steps, guidance_scale=guidance, temperature=temperature
    )
    return events, seen, decoder


@pytest.mark.parametrize("max_text_len", [512, 6])
def test_prompt_layout_is_t2i_gen_prompt(loaded, max_text_len):
    model, tok = loaded
    spec = replace(image_spec_of(model), max_text_len=max_text_len)
    ids, pads = t2i_rows(tok, spec, PROMPTS + [""], NUM_VQ_TOKENS)
    want, mask = ref.t2i_gen_prompt(
        tok._tokenizer,
        PROMPTS + [""],
        NUM_VQ_TOKENS,
        max_text_len,
        IDS,
        MMADA_TOKENS["<|mdm_mask|>"],
    )
    np.testing.assert_array_equal(np.array(ids), want.numpy())
    assert pads == [int((m == 0).sum()) for m in mask]


@pytest.mark.parametrize(
    "guidance, steps, temperature, max_text_len",
    [
        pytest.param(3.5, 15, 1.0, 512, marks=pytest.mark.slow),
        (0.0, 6, 1.0, 16),
        (1.5, 12, 0.0, 16),
    ],
)
def test_steps_match_t2i_generate_with_the_same_draws(
    ckpt, loaded, guidance, steps, temperature, max_text_len
):
    model, tok = loaded
    events, seen, decoder = mlx_run(
        model,
        tok,
        PROMPTS,
        guidance=guidance,
        steps=steps,
        temperature=temperature,
        max_text_len=max_text_len,
    )
    final, record = reference_run(
        ckpt,
        tok._tokenizer,
        PROMPTS,
        guidance=guidance,
        steps=steps,
        temperature=temperature,
        max_text_len=max_text_len,
        n_tokens=NUM_VQ_TOKENS,
    )
    assert decoder.nfe == steps
    masked = []
    for event, logits, (sampled, masking, ref_logits) in zip(events, seen, record):
        np.testing.assert_allclose(logits, ref_logits.numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(np.array(event.sampled), sampled.numpy())
        np.testing.assert_array_equal(np.array(event.masking), masking.numpy())
        masked.append(int(masking.sum()))
    np.testing.assert_array_equal(np.array(events[-1].sampled), final.numpy())
    # The schedule really unmasks over the steps (the cosine schedule, one left at the end).
    assert masked[0] > masked[-2] > 0 and masked[-1] == len(PROMPTS)


@pytest.mark.parametrize("n", [16, 64, 256, 1024, 4096])
def test_mask_lengths_are_torchs_float32_schedule(n):
    unknown = mx.ones((1, n), dtype=mx.bool_)
    for steps in range(1, 41):
        for step in range(steps):
            ratio = ref.cosine_schedule(torch.tensor(1.0 * (step + 1) / steps))
            want = max(1, min(n - 1, int((n * ratio).floor())))
            assert int(mask_lengths(step, steps, n, unknown)[0]) == want, (steps, step)
            assert abs(cosine_mask_ratio(step, steps) - float(ratio)) <= 1.2e-7


def test_vq_decoder_and_encoder_match_the_reference(ckpt):
    config, weights = vq_arrays()
    enc, dec = ref.vq_models(config, weights)
    vq = magvitv2.load(ckpt / "vq_model")
    rng = np.random.default_rng(3)
    for shape in [(4, 4), (2, 6)]:
        codes = rng.integers(0, 64, size=(2, shape[0] * shape[1]))
        with torch.no_grad():
            want = dec(ref.codebook_entry(torch.from_numpy(codes), 6, shape)).permute(0, 2, 3, 1)
        got = vq.decode_code(mx.array(codes), shape)
        np.testing.assert_allclose(np.array(got), want.numpy(), atol=1e-4, rtol=1e-4)
    pixels = rng.uniform(-1, 1, size=(2, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        z = enc(torch.from_numpy(pixels))
    want = ref.get_indices(z, 6).reshape(2, -1).numpy()
    got = np.array(vq.get_code(mx.array(pixels.transpose(0, 2, 3, 1))))
    # A latent within float noise of 0 could take either sign; none is on this input.
    assert np.abs(z.numpy()).min() > 1e-4
    np.testing.assert_array_equal(got, want)


# End to end: five whole images (512 text columns, guidance, the VQ decoder); the batch's rows are
# checked fast against the reference's batch by test_the_api_runs_the_reference_with_its_settings.
@pytest.mark.slow
def test_batch_rows_equal_their_single_runs(loaded, ckpt):
    model, tok = loaded
    batch = batch_generate_image(model, tok, PROMPTS, seed=5, steps=6)
    for i, prompt in enumerate(PROMPTS):
        alone = generate_image(model, tok, prompt, seed=5 + i, steps=6)
        np.testing.assert_array_equal(np.asarray(batch[i]), np.asarray(alone))
    other = generate_image(model, tok, PROMPTS[0], seed=6, steps=6)
    assert not np.array_equal(np.asarray(other), np.asarray(batch[0]))


def test_stream_yields_every_k_steps_and_ends_with_the_image(loaded):
    model, tok = loaded
    steps = list(stream_generate_image(model, tok, PROMPTS[0], every=2, steps=5, seed=1))
    assert [s.step for s in steps] == [2, 4, 5]
    assert all(s.steps == 5 for s in steps)
    final = generate_image(model, tok, PROMPTS[0], steps=5, seed=1)
    np.testing.assert_array_equal(np.asarray(steps[-1].image), np.asarray(final))
    assert steps[-1].nfe == 5
    assert len(steps[-1].tokens) == NUM_VQ_TOKENS and all(0 <= t < 64 for t in steps[-1].tokens)


def test_size_is_the_token_grid(loaded):
    model, tok = loaded
    # The fixture's 16 tokens and 4 pixels a token: 16x16 by default.
    assert generate_image(model, tok, "x", steps=2).size == (16, 16)
    wide = generate_image(model, tok, "x", steps=2, width=32, height=8)
    assert wide.size == (32, 8)
    with pytest.raises(SettingsError, match="multiple of 4"):
        generate_image(model, tok, "x", width=18)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "steps must be a positive integer"),
        ({"guidance_scale": -1.0}, "guidance_scale must be a number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0"),
        ({"max_text_len": 0}, "max_text_len must be a positive integer"),
        ({"every": 0}, "every must be a positive integer"),
        ({"seed": [1, 2]}, "2 seeds for 1 prompts"),
    ],
)
def test_bad_settings_say_what_is_wrong(loaded, kwargs, message):
    model, tok = loaded
    with pytest.raises(SettingsError, match=message):
        list(stream_batch(model, tok, ["x"], **kwargs))


def test_a_text_model_cannot_generate_images(fixture_dir):
    model, tok = load(str(build_once(fixture_dir / "llada", build_llada)))
    with pytest.raises(SettingsError, match="cannot generate images"):
        generate_image(model, tok, "a cat")


def test_a_missing_vq_model_is_named(loaded, tmp_path):
    model, tok = loaded
    with pytest.raises(SettingsError, match="no VQ model"):
        generate_image(model, tok, "a cat", vq_model=tmp_path / "none")


@pytest.mark.slow
def test_whole_path_writes_a_png(loaded, tmp_path):
    from PIL import Image

    model, tok = loaded
    out = tmp_path / "cat.png"
    generate_image(model, tok, "a red cat", width=32, height=32, seed=0).save(out)
    back = Image.open(out)
    assert back.format == "PNG" and back.size == (32, 32) and back.mode == "RGB"
    assert len(np.unique(np.asarray(back).reshape(-1, 3), axis=0)) > 1
    assert math.isfinite(float(np.asarray(back).mean()))


def test_the_api_runs_the_reference_with_its_settings(ckpt, loaded):
    """stream_batch's settings reach the loop: the final tokens of the reference at guidance 2,
    8 steps, temperature 0.5 and 16 text columns, with the same draws."""
    model, tok = loaded
    settings = dict(guidance=2.0, steps=8, temperature=0.5, max_text_len=15)
    final, _ = reference_run(ckpt, tok._tokenizer, PROMPTS, n_tokens=NUM_VQ_TOKENS, **settings)
    np_draws = numpy_draws(len(PROMPTS), NUM_VQ_TOKENS)
    *_, last = stream_batch(
        model,
        tok,
        PROMPTS,
        guidance_scale=2.0,
        steps=8,
        temperature=0.5,
        max_text_len=15,
        every=8,
        draws=lambda s: tuple(mx.array(a) for a in np_draws(s)),
    )
    assert [r.tokens for r in last] == final.tolist()
