"""Inpainting with MMaDA: the image prepared as app.py's image_transform and encoded by the VQ
model, the mask's white cells decoded by t2i_generate's own loop (it keeps every given image
column), against the torch transcription with the same draws; a batch mixing an inpainted row and
a plain one."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image

from fixtures.mmada import MMADA_TOKENS, NUM_VQ_TOKENS, TEXT_VOCAB, build_mmada, vq_arrays
from helpers import checkpoint_fixtures
from mlx_dllm_models.errors import SettingsError
from mlx_dllm_models.image_codes import pixels, repaint_cells
from mlx_dllm_models.images import decoder_for, generate_image, image_spec_of, resolve_vq_model
from reference import mmada_torch as ref

IDS = {n: MMADA_TOKENS[n] for n in ("<|t2i|>", "<|soi|>", "<|eoi|>", "[iPAD]")}
MASK_ID = MMADA_TOKENS["<|mdm_mask|>"]


ckpt, loaded = checkpoint_fixtures("mmada", build_mmada)


def photo(w=23, h=17, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def left_half_mask(size=16):
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[:, : size // 2] = 255
    return Image.fromarray(mask)


@pytest.mark.parametrize("w, h", [(23, 17), (17, 23), (16, 16), (40, 40)])
def test_pixels_are_app_pys_image_transform(w, h):
    image = photo(w, h)
    got = np.array(pixels(image, 16, 16))[0]
    want = ref.image_transform(image, 16).permute(1, 2, 0).numpy()
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_mask_cells_are_any_white_pixel():
    mask = np.zeros((16, 16), dtype=np.uint8)
    mask[5, 9] = 255  # one pixel in cell (row 1, column 2) of a 4x4 grid of 4-pixel cells
    cells = repaint_cells(Image.fromarray(mask), 4, 4, 4)
    assert cells.tolist() == [i == 1 * 4 + 2 for i in range(16)]
    assert repaint_cells(np.ones((16, 16), dtype=bool), 4, 4, 4).all()


def test_inpainting_steps_match_t2i_generate(ckpt, loaded):
    model, tok = loaded
    spec = image_spec_of(model)
    vq = resolve_vq_model(tok, spec)
    prompts = ["a red cat", "a green bird"]
    given = dict(images=[photo(), None], masks=[left_half_mask(), None])
    decoder, _, steps, guidance = decoder_for(
        model, tok, prompts, spec, vq, steps=8, guidance_scale=3.5, **given
    )
    start = np.array(decoder.ids)
    image_cols = start[:, -(NUM_VQ_TOKENS + 1) : -1]
    # Row 0: the right half given (the photo's codes, from the torch encoder too), row 1: none.
    config, weights = vq_arrays()
    enc, _ = ref.vq_models(config, weights)
    with torch.no_grad():
        z = enc(ref.image_transform(photo(), 16)[None])
    codes = ref.get_indices(z, 6).reshape(-1).numpy()
    given = np.tile([False, False, True, True], 4)
    assert (image_cols[0][~given] == MASK_ID).all()
    np.testing.assert_array_equal(image_cols[0][given] - TEXT_VOCAB, codes[given])
    assert (image_cols[1] == MASK_ID).all()

    rng = np.random.default_rng(4)
    draws = [rng.random((2, 2, NUM_VQ_TOKENS), dtype=np.float32) for _ in range(steps)]
    events = list(
        decoder.run(
            steps=steps,
            guidance_scale=guidance,
            temperature=1.0,
            draws=lambda s: (mx.array(draws[s][0]), mx.array(draws[s][1])),
        )
    )
    _, mask = ref.t2i_gen_prompt(tok._tokenizer, prompts, NUM_VQ_TOKENS, 512, IDS, MASK_ID)
    uncond = ref.t2i_gen_prompt(tok._tokenizer, ["", ""], NUM_VQ_TOKENS, 512, IDS, MASK_ID)
    final, record = ref.t2i_generate(
        ref.forward_with_bias(ckpt),
        torch.from_numpy(start.astype(np.int64)),
        uncond[0],
        mask,
        uncond[1],
        temperature=1.0,
        timesteps=steps,
        guidance_scale=guidance,
        seq_len=NUM_VQ_TOKENS,
        resolution=512,
        offset=TEXT_VOCAB,
        codebook_size=64,
        mask_token_id=MASK_ID,
        draws=lambda s: (draws[s][0], draws[s][1]),
    )
    for event, (sampled, masking, _) in zip(events, record):
        np.testing.assert_array_equal(np.array(event.sampled), sampled.numpy())
        np.testing.assert_array_equal(np.array(event.masking), masking.numpy())
    final = final.numpy()
    np.testing.assert_array_equal(np.array(events[-1].sampled), final)
    np.testing.assert_array_equal(final[0][given], codes[given])  # the given half is kept


def test_generate_image_inpaints(loaded):
    model, tok = loaded
    out = generate_image(model, tok, "a cat", image=photo(), mask=left_half_mask(), steps=4)
    assert out.size == (16, 16)
    with pytest.raises(SettingsError, match="an image without a mask"):
        generate_image(model, tok, "a cat", image=photo())
    with pytest.raises(SettingsError, match="a mask without an image"):
        generate_image(model, tok, "a cat", mask=left_half_mask())
    with pytest.raises(SettingsError, match="repaints nothing"):
        generate_image(model, tok, "a cat", image=photo(), mask=np.zeros((16, 16), np.uint8))
