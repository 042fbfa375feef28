"""Lumina-DiMOO's image editing (scripts/inference_i2i.py, edit types "edit_*") against the torch
transcription (tests/reference/lumina_dimoo_torch.py): the VQ encoder's codes, the three rows'
layout, every step's tokens and masking under text and image guidance with the same draws; the
API (a batch equals its single runs, the output keeps the input's crop size)."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image

from fixtures import lumina_dimoo as fx
from helpers import checkpoint_fixtures
from image_checks import run_on_draws
from mlx_dllm_models.errors import SettingsError
from mlx_dllm_models.image_layout import crop_sizes, edit_picture, edit_pixels
from mlx_dllm_models.images import (
    batch_generate_image,
    decoder_for,
    generate_image,
    image_spec_of,
    resolve_vq_model,
)
from mlx_dllm_models.models import vqmodel
from reference import lumina_dimoo_torch as ref
from reference.llada_torch import torch_forward

MASK = fx.DIMOO_TOKENS["<|mdm_mask|>"]
PROMPTS = ["add a red hat", "make the sky green"]

ckpt, loaded = checkpoint_fixtures("lumina_dimoo", fx.build_lumina_dimoo)


def photo(seed, size=(40, 24)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


def test_crops_are_var_center_crops_sizes():
    sizes = crop_sizes(16 * 16, 32)
    assert (512, 512) in sizes and (1024, 256) in sizes and (2048, 128) not in sizes
    assert edit_picture(photo(0, (600, 300)), 512).size == (704, 352)
    assert edit_picture(photo(0, (40, 24)), 32).size == (32, 32)


def test_encoder_codes_match_diffusers_encode(ckpt):
    config, weights = fx.vq_arrays()
    vq = vqmodel.load(ckpt / "vqvae")
    pixels = edit_pixels(photo(1, (16, 12)))
    got = np.array(vq.get_code(mx.array(pixels)))
    want = ref.vq_encode(config, weights, torch.from_numpy(pixels).permute(0, 3, 1, 2))
    np.testing.assert_array_equal(got, want.numpy())


def numpy_draws(batch, n_tokens, seed=0):
    return ref.numpy_draws(batch, n_tokens, fx.CODEBOOK, seed)


def edit_decoder(loaded, pictures, guidance, image_guidance):
    model, tok = loaded
    spec = replace(image_spec_of(model), edit_side=32)
    vq = resolve_vq_model(tok, spec)
    edits = dict(images=pictures, image_guidance_scale=image_guidance)
    dec, shape, _, _ = decoder_for(
        model, tok, PROMPTS, spec, vq, steps=4, guidance_scale=guidance, **edits
    )
    return dec, shape, vq


@pytest.mark.slow
@pytest.mark.parametrize("guidance, image_guidance, steps", [(2.5, 4.0, 5), (0.0, 3.0, 3)])
def test_edit_steps_match_generate_i2i(ckpt, loaded, guidance, image_guidance, steps):
    """The layout of the three rows and every step, the rows batched and padded here, each
    prompt alone and unpadded (three forwards a step) in the reference."""
    _, tok = loaded
    pictures = [photo(2, (16, 12)), photo(3, (16, 12))]
    cropped = [edit_picture(p, 32) for p in pictures]
    dec, (h, w), vq = edit_decoder(loaded, cropped, guidance, image_guidance)
    assert dec.nfe == 0 and len(dec.uncond) == 2
    draws = numpy_draws(len(PROMPTS), h * w)
    events = run_on_draws(dec, draws, steps=steps, guidance_scale=guidance, temperature=1.0)
    forward = torch_forward(ckpt)
    for row, (prompt, picture) in enumerate(zip(PROMPTS, cropped)):
        codes = np.array(vq.get_code(mx.array(edit_pixels(picture))))[0]
        con, uncon_text, uncon_image, code_start = ref.i2i_prompt(
            tok._tokenizer, prompt, codes, h, w, fx.GRID_IDS, MASK, fx.IMAGE_OFFSET
        )
        pad = dec.pads[row]
        np.testing.assert_array_equal(
            np.array(dec.ids)[row, pad : pad + code_start - 2], con[0, : code_start - 2].numpy()
        )
        final, ref_steps = ref.generate_image(
            forward,
            con,
            seq_len=h * w,
            timesteps=steps,
            mask_token_id=MASK,
            newline_id=fx.GRID_IDS["newline_token"],
            temperature=1.0,
            cfg_scale=guidance,
            uncon_ids=uncon_text,
            code_start=code_start,
            codebook_size=fx.CODEBOOK,
            draws=lambda s: tuple(a[row] for a in draws(s)),
            cfg_img=image_guidance,
            uncon_image=uncon_image,
        )
        for event, (codes_s, masked) in zip(events, ref_steps):
            np.testing.assert_array_equal(np.array(event.masking[row]), masked.numpy())
            sampled = np.array(event.sampled[row])
            np.testing.assert_array_equal(sampled[~masked.numpy()], codes_s[~masked].numpy())
        np.testing.assert_array_equal(np.array(events[-1].sampled[row]), final[0].numpy())


@pytest.mark.slow
def test_editing_api_keeps_the_crop_size_and_batches_equal_singles(loaded):
    model, tok = loaded
    pictures = [photo(4, (40, 24)), photo(5, (40, 24))]
    kw = dict(steps=2, edit_side=64)
    batch = batch_generate_image(model, tok, PROMPTS, images=pictures, seed=[1, 7], **kw)
    for i, (image, seed) in enumerate(zip(batch, (1, 7))):
        single = generate_image(model, tok, PROMPTS[i], image=pictures[i], seed=seed, **kw)
        assert single.size == image.size == edit_picture(pictures[i], 64).size == (64, 32)
        np.testing.assert_array_equal(np.asarray(single), np.asarray(image))


def test_editing_refusals(loaded):
    model, tok = loaded
    picture = photo(6, (16, 16))
    with pytest.raises(SettingsError, match="no inpainting here"):
        generate_image(model, tok, "x", image=picture, mask=picture, steps=1, edit_side=32)
    with pytest.raises(SettingsError, match="in every row or in none"):
        batch_generate_image(model, tok, ["a", "b"], images=[picture, None], edit_side=32)
    with pytest.raises(SettingsError, match="keeps its input's crop size"):
        generate_image(model, tok, "x", image=picture, width=16, height=32, edit_side=32)
