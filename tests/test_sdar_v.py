"""SDAR-VL (model_type sdar_v): the vision path (mlx-vlm's SigLIP tower, projector and anyres
packing), the block-causal logits over a prompt holding an image, and decoding at the reference's
defaults (tokens and forwards), each against the torch transcription of JetAstra/SDAR-VL
(tests/reference/sdar_v_torch.py, reference/sdar_generate.py)."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures.sdar import ENDOFTEXT, IM_END, MASK
from fixtures.sdar_v import IMAGE_PAD, TILE, build_sdar_v
from helpers import assert_close, checkpoint_fixtures, cut_at_eos, far, random_picture
from mlx_dllm_models.engine import BlockEvent
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.masks import block_causal_mask
from reference import sdar_v_torch as ref
from reference.sdar_generate import block_causal_keep, sdar_generate

ckpt, loaded = checkpoint_fixtures("sdar_v", build_sdar_v)


def tile(seed):
    return np.random.default_rng(seed).uniform(-1, 1, (1, 3, TILE, TILE)).astype(np.float32)


def as_reference_ids(model, ids):
    """The reference's prompt: `<|image_pad|>` where this package holds an image id."""
    return [IMAGE_PAD if t >= model.args.vocab_size else t for t in ids]


@pytest.mark.parametrize("size", [None, (70, 130), (150, 60)])
def test_image_features_match_reference(loaded, ckpt, size):
    """One tile (its features, then one newline), and anyres images whose tiles are unpadded
    and packed with a newline per row."""
    model, processor = loaded
    if size is None:
        pixels, image_size = tile(0), (TILE, TILE)
    else:
        pixels, image_size = processor.preprocess(random_picture(1, size))
        assert pixels.shape[0] > 1
    got = np.array(model.image_features(pixels, image_size if size else None))
    want = ref.image_features(ckpt, pixels, image_size).numpy()
    assert got.shape == want.shape
    assert_close(got, want)


def test_anyres_features_past_the_patch_cap_are_downsampled_as_the_reference(fixture_dir):
    """anyres_max_1: a 2 x 3 tile image is past the cap (ratio > 1.1), so its unpadded grid is
    downsampled bilinearly (torch's interpolate, align_corners False) before the newlines."""
    from mlx_dllm_models import load

    path = build_once(fixture_dir / "sdar_v_max1", build_sdar_v, vision_aspect_ratio="anyres_max_1")
    model, processor = load(path)
    pixels, size = processor.preprocess(random_picture(5, (100, 160)))
    got = np.array(model.image_features(pixels, size))
    want = ref.image_features(path, pixels, size).numpy()
    assert got.shape == want.shape and got.shape[0] < (pixels.shape[0] - 1) * 16
    assert_close(got, want)


def test_block_causal_logits_over_an_image_prompt_match_reference(loaded, ckpt):
    model, _ = loaded
    slots = model.image_slots(tile(2))
    ids = [IM_END, 72, 105] + slots + [33, 100, 40] + [MASK] * 9
    L = len(ids)
    got = np.array(model(mx.array([ids]), mask=block_causal_mask(L, 4)))
    feats = ref.image_features(ckpt, tile(2), (TILE, TILE))
    keep = block_causal_keep(-(-L // 4) * 4, 4)[:L, :L]
    want = ref.logits(ckpt, as_reference_ids(model, ids), feats, keep).numpy()
    assert_close(got, want)
    # The mask and the image matter: every key, or another image, reads otherwise.
    full = torch.ones(L, L, dtype=torch.bool)
    assert far(got, ref.logits(ckpt, as_reference_ids(model, ids), feats, full).numpy())
    other = model.image_slots(tile(3))
    ids2 = [IM_END, 72, 105] + other + [33, 100, 40] + [MASK] * 9
    assert far(np.array(model(mx.array([ids2]), mask=block_causal_mask(L, 4))), want)


def run(model, processor, prompt, **kw):
    _, (ids,), decoder = stream_events(model, processor, [prompt], **kw)
    out = []
    for event in decoder.run([ids]):
        if isinstance(event, BlockEvent):
            out.extend(event.tokens[0])
    return out, ids, decoder


# generate.py's demo call (block_length = denoising_steps = 4, low_confidence_static), and
# block_diffusion_generate's own defaults (block_length 8, denoising_steps 8,
# low_confidence_dynamic at confidence_threshold 0.9).
CALLS = {
    "demo": (
        {},
        dict(block_length=4, denoising_steps=4, remasking_strategy="low_confidence_static"),
    ),
    "function": (
        dict(sampler="threshold", block_length=8, steps=8, threshold=0.9),
        dict(
            block_length=8,
            denoising_steps=8,
            remasking_strategy="low_confidence_dynamic",
            confidence_threshold=0.9,
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "call, text, gen",
    [
        ("demo", "describe", 24),
        ("demo", "what is in the picture here?", 29),
        ("function", "hi", 30),
    ],
)
def test_generate_matches_the_references_tokens_and_forwards(loaded, ckpt, call, text, gen):
    """Greedy, on the chat template's prompt with an image: the same tokens, and the reference's
    forwards less the one store forward per finished block that the exact block cache folds into
    the next block's first forward. The package's defaults are the demo call's."""
    model, processor = loaded
    spec = model.diffusion_spec
    assert spec.defaults["sampler"] == "quota"
    assert (spec.defaults["block_length"], spec.defaults["steps"]) == (4, 4)
    settings, reference = CALLS[call]
    picture = random_picture(4, (70, 130))
    messages = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    got, ids, dec = run(model, processor, prompt, images=[[picture]], max_tokens=gen, **settings)
    pixels, size = processor.preprocess(picture)
    feats = ref.image_features(ckpt, pixels, size)
    x, ref_forwards = sdar_generate(
        ref.forward(ckpt, feats),
        torch.tensor([as_reference_ids(model, ids)]),
        MASK,
        gen_length=gen,
        temperature=0.0,
        stopping_criteria_idx=[IM_END, ENDOFTEXT],
        **reference,
    )
    want = cut_at_eos(x[0, len(ids) : len(ids) + gen], {IM_END, ENDOFTEXT})
    assert got == want and len(got) > 4
    assert dec.nfe == ref_forwards - dec.backend.commits_saved
