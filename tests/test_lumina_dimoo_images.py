"""Lumina-DiMOO's text-to-image path against the torch transcription of the reference
(tests/reference/lumina_dimoo_torch.py) on the tiny fixture: the prompt layout, the guided
image-token logits, the tokens and masking of every step with the same draws injected, the
schedule, the VQ decoder's pixels; then the API (batch rows equal their single runs, streaming,
refusals)."""

import math

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.lumina_dimoo import (
    CODEBOOK,
    DIMOO_TOKENS,
    DOWNSAMPLE,
    GRID_IDS,
    IMAGE_OFFSET,
    build_lumina_dimoo,
    vq_arrays,
)
from helpers import checkpoint_fixtures
from image_checks import run_on_draws
from mlx_dllm_models.decoding.gumbel_maskgit import keep_counts, keep_fraction
from mlx_dllm_models.errors import SettingsError
from mlx_dllm_models.images import (
    batch_generate_image,
    decoder_for,
    generate_image,
    image_spec_of,
    resolve_vq_model,
    stream_generate_image,
)
from mlx_dllm_models.models import vqmodel
from reference import lumina_dimoo_torch as ref
from reference.llada_torch import torch_forward

PROMPTS = ["a red cat", "two green birds over the sea at dusk"]
MASK = DIMOO_TOKENS["<|mdm_mask|>"]
SHAPE = (3, 4)  # token rows, columns: a 16 x 12 image

ckpt, loaded = checkpoint_fixtures("lumina_dimoo", build_lumina_dimoo)


def numpy_draws(batch, n_tokens, seed=0):
    return ref.numpy_draws(batch, n_tokens, CODEBOOK, seed)


def decoder(loaded, prompts, guidance):
    model, tok = loaded
    spec = image_spec_of(model)
    vq = resolve_vq_model(tok, spec)
    h, w = SHAPE
    size = dict(width=w * DOWNSAMPLE, height=h * DOWNSAMPLE)
    return decoder_for(model, tok, prompts, spec, vq, **size, steps=4, guidance_scale=guidance)


def reference_run(ckpt, tok, prompt, row, *, guidance, steps, temperature):
    h, w = SHAPE
    prompt_ids, uncon_ids, code_start = ref.t2i_prompt(tok._tokenizer, prompt, h, w, GRID_IDS, MASK)
    all_draws = numpy_draws(len(PROMPTS), h * w)
    return ref.generate_image(
        torch_forward(ckpt),
        prompt_ids,
        seq_len=h * w,
        timesteps=steps,
        mask_token_id=MASK,
        newline_id=GRID_IDS["newline_token"],
        temperature=temperature,
        cfg_scale=guidance,
        uncon_ids=uncon_ids,
        code_start=code_start,
        codebook_size=CODEBOOK,
        draws=lambda s: tuple(a[row] for a in all_draws(s)),
    )


def test_prompt_layout_is_inference_t2is(loaded):
    model, tok = loaded
    dec, shape, _, _ = decoder(loaded, PROMPTS, 4.0)
    assert shape == SHAPE
    ids = np.array(dec.ids)
    for row, prompt in enumerate(PROMPTS):
        want, uncon, code_start = ref.t2i_prompt(tok._tokenizer, prompt, *SHAPE, GRID_IDS, MASK)
        pad = dec.pads[row]
        np.testing.assert_array_equal(ids[row, pad:], want[0].numpy())
        upad = dec.uncond[0].pads[row]
        np.testing.assert_array_equal(np.array(dec.uncond[0].prefix)[row, upad:], uncon[0].numpy())
        image = np.array(dec.columns) - pad
        assert list(image[:4]) == [code_start + c for c in range(4)]
        assert ids[row, pad + code_start + 4] == GRID_IDS["newline_token"]  # a row's end
    assert dec.offset == IMAGE_OFFSET


@pytest.mark.slow
@pytest.mark.parametrize("guidance", [4.0, 0.0])
def test_guided_image_logits_match_the_reference(ckpt, loaded, guidance):
    """Step 0's (1 + g) cond - g uncond over the masked positions, the rows batched and padded
    here, each run alone and unpadded by the reference: the logits to 1e-4, which the guided
    combination scales by up to 1 + 2g."""
    _, tok = loaded
    dec, _, _, _ = decoder(loaded, PROMPTS, guidance)
    got = np.array(dec.logits(guidance))
    forward = torch_forward(ckpt)
    for row, prompt in enumerate(PROMPTS):
        x, uncon, code_start = ref.t2i_prompt(tok._tokenizer, prompt, *SHAPE, GRID_IDS, MASK)
        window = slice(IMAGE_OFFSET, IMAGE_OFFSET + CODEBOOK)
        vq_mask = x == MASK
        cond = forward(x)[..., window][vq_mask]
        want = cond
        if guidance:
            unc = torch.cat((uncon, x[:, code_start - 2 :]), axis=1)
            umask = torch.cat(
                (torch.zeros_like(uncon, dtype=torch.bool), vq_mask[:, code_start - 2 :]), 1
            )
            want = (1 + guidance) * cond - guidance * forward(unc)[..., window][umask]
        tol = 1e-4 * (1 + 2 * guidance)
        np.testing.assert_allclose(got[row], want.numpy(), atol=tol, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "guidance, steps, temperature", [(4.0, 6, 1.0), (0.0, 4, 1.0), (2.5, 5, 0.0)]
)
def test_steps_match_the_reference_with_the_same_draws(ckpt, loaded, guidance, steps, temperature):
    """Every step's sampled codes and masking (the unmasking order), rows batched here."""
    _, tok = loaded
    dec, _, _, _ = decoder(loaded, PROMPTS, guidance)
    draws = numpy_draws(len(PROMPTS), SHAPE[0] * SHAPE[1])
    events = run_on_draws(dec, draws, steps=steps, guidance_scale=guidance, temperature=temperature)
    assert dec.nfe == steps
    for row, prompt in enumerate(PROMPTS):
        final, ref_steps = reference_run(
            ckpt, tok, prompt, row, guidance=guidance, steps=steps, temperature=temperature
        )
        assert len(ref_steps) == steps
        for event, (codes, masked) in zip(events, ref_steps):
            np.testing.assert_array_equal(np.array(event.masking[row]), masked.numpy())
            sampled = np.array(event.sampled[row])
            np.testing.assert_array_equal(sampled[~masked.numpy()], codes[~masked].numpy())
        assert not np.array(events[-1].masking[row]).any()
        np.testing.assert_array_equal(np.array(events[-1].sampled[row]), final[0].numpy())
    # The masked count follows the schedule: floor(N cos(pi/2 (s + 1) / S)), none at the end.
    left = [int(np.array(e.masking[0]).sum()) for e in events]
    n = SHAPE[0] * SHAPE[1]
    assert left == [max(1, math.floor(n * keep_fraction(s, steps))) for s in range(steps - 1)] + [0]


def test_schedule_is_torchs_float32_cosine():
    for steps in (2, 7, 18, 64, 100):
        for step in range(steps - 1):
            frac = ref.cosine_schedule(torch.tensor([(step + 1) / steps]))
            for n0 in (12, 1024, 4096, 8192):
                want = (torch.tensor([[n0]]).float() * frac).floor().clamp_min(1).long()
                got = keep_counts(step, steps, mx.array([n0]))
                assert int(got[0]) == int(want[0, 0]), (steps, step, n0)
    assert int(keep_counts(5, 6, mx.array([16]))[0]) == 0


def test_vq_decoder_pixels_match_diffusers_decode(ckpt):
    config, weights = vq_arrays()
    vq = vqmodel.load(ckpt / "vqvae")
    assert (vq.codebook_size, vq.downsample) == (CODEBOOK, DOWNSAMPLE)
    rng = np.random.default_rng(3)
    codes = rng.integers(0, CODEBOOK, size=(2, 12))
    got = np.array(vq.decode_code(mx.array(codes), (3, 4)))
    want = ref.VQDecoder(config, weights)(torch.from_numpy(codes), 3, 4)
    np.testing.assert_allclose(got, want.permute(0, 2, 3, 1).numpy(), atol=1e-4, rtol=1e-4)
    pixels = vqmodel.to_uint8(mx.array(got))
    # uint8 rounding of values a float ulp apart may differ by one level
    assert np.abs(pixels.astype(int) - ref.to_pixels(want).astype(int)).max() <= 1


@pytest.mark.slow
def test_batch_rows_equal_their_single_runs_and_stream_ends_on_the_image(loaded):
    model, tok = loaded
    kw = dict(width=16, height=12, steps=3, guidance_scale=4.0)
    batch = batch_generate_image(model, tok, PROMPTS, seed=[5, 9], **kw)
    for prompt, seed, image in zip(PROMPTS, (5, 9), batch):
        single = generate_image(model, tok, prompt, seed=seed, **kw)
        assert single.size == (16, 12)
        np.testing.assert_array_equal(np.asarray(image), np.asarray(single))
    events = list(stream_generate_image(model, tok, PROMPTS[0], every=2, seed=5, **kw))
    assert [e.step for e in events] == [2, 3] and events[-1].nfe == 3
    np.testing.assert_array_equal(np.asarray(events[-1].image), np.asarray(batch[0]))
    assert all(0 <= t < CODEBOOK for t in events[-1].tokens)


def test_defaults_and_refusals(loaded):
    model, tok = loaded
    spec = model.image_spec
    assert (spec.steps, spec.guidance_scale, spec.temperature) == (64, 4.0, 1.0)
    assert (spec.codebook_size, spec.num_vq_tokens, spec.vq_subfolder) == (8192, 4096, "vqvae")
    blank = np.zeros((16, 16, 3), np.uint8)
    with pytest.raises(SettingsError, match="no inpainting here"):
        generate_image(model, tok, "a cat", image=blank, mask=blank, width=16, height=16)
    with pytest.raises(SettingsError, match="not a multiple of 4"):
        generate_image(model, tok, "a cat", width=18, height=16)
