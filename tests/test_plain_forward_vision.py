"""`model(ids)` with no mask computes what the upstream model's own forward computes (issue 43), for
DiffusionGemma and the vision families; text-only ids first, then with an image's features spliced
in where the reference's forward takes them. Each is held against the reference's plain forward on
a fixture and against another reading (so that the comparison can fail):

* DiffusionGemma: upstream's forward (transformers' DiffusionGemmaForBlockDiffusion) encodes
  `input_ids` causally into a cache and returns the decoder's logits over `decoder_input_ids`, the
  canvas, attending bidirectionally to the prefix and the canvas. The package's protocol call is
  that decoder: `model(canvas, cache=encoded prompt)`; `model(ids)` alone reads the ids as a canvas
  after an empty prefix (upstream's decoder over a cache cut to no position). It is never the
  encoder's causal next-token reading.
* LLaDA-V (ML-GSAI/LLaDA-V, LLaDAModelLM: is_causal=False): every key, over text and image rows.
* LaViDa, both language models (jacklishufan/LaViDa): the forward without prefix_lm (LLaDA's
  `model(None, input_embeddings=...)`, Dream's forward_dream with no cache) attends to every key;
  Dream's logits unshifted (the shift is generate's, not the forward's).
* Nemotron-VLM: the remote code's language model defaults to use_causal_mask=False.
* Dimple (DimpleModel.forward: Dream's bidirectional body with M-RoPE): every key.
The text forwards are held through the package's load, mlx_lm.load and mlx_vlm.load. The image
forwards of LLaDA-V, Nemotron-VLM and Dimple are plain calls in their families' files
(test_logits_over_an_image_prompt_match_reference); LaViDa's is here, its reading differing (the
image prompt without the prefix layout).
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures import diffusion_gemma as gemma_fixture
from fixtures import dimple as dimple_fixture
from fixtures import nemotron as nemotron_text_fixture
from fixtures import nemotron_vlm as nemotron_vlm_fixture
from fixtures.lavida import build_lavida, build_lavida_dream
from fixtures.llada_v import build_llada_v
from helpers import assert_close, far, load_fixture, random_picture
from mlx_dllm_models.masks import causal_mask
from reference import dimple_torch, lavida_torch, llada_v_torch
from reference import nemotron_vlm_torch as nemotron_vlm_ref


def ids(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (1, n))


def plain(model, x):
    return np.array(model(mx.array(x)).astype(mx.float32))


def causal(model, x):
    return np.array(model(mx.array(x), mask=causal_mask(x.shape[1])).astype(mx.float32))


def _emptied(cache):
    """transformers' cache of an encoded prompt with every layer cut to no position: its decoder
    refuses a cache never written, so this is how it reads a canvas after an empty prefix."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :0], layer.values[:, :, :0]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = 0
    return cache


@pytest.mark.slow
def test_diffusion_gemma_plain_call_is_its_decoder_forward(fixture_dir):
    """transformers' DiffusionGemmaForBlockDiffusion.forward(input_ids=prompt,
    decoder_input_ids=canvas) is the package's call over the canvas with the prompt encoded in the
    cache; with no cache, over an empty prefix."""
    from transformers import DiffusionGemmaForBlockDiffusion

    ckpt = build_once(fixture_dir / "diffusion_gemma", gemma_fixture.CHECKPOINTS["diffusion_gemma"])
    model = load_fixture(ckpt)[0]
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt), dtype=torch.float32)
    reference.eval()
    prompt = ids(11, 43)
    prompt[0, 0] = gemma_fixture.BOS
    x = ids(gemma_fixture.CANVAS_LENGTH, 23)
    with torch.no_grad():
        out = reference(input_ids=torch.as_tensor(prompt), decoder_input_ids=torch.as_tensor(x))
        alone = reference(cache=_emptied(out.cache), decoder_input_ids=torch.as_tensor(x))
    cache = model.make_cache()
    model.encode(mx.array(prompt), cache)
    assert_close(np.array(model(mx.array(x), cache=cache)), out.logits.numpy())
    want = alone.logits.numpy()
    got = plain(model, x)
    assert_close(got, want)
    assert far(got, causal(model, x))
    assert far(got, out.logits.numpy())  # the prefix is read
    assert_close(np.array(model(mx.array(x), head_span=(3, 9))), want[:, 3:9])


def _llada_v_text(ckpt, x):
    embeds = llada_v_torch.embed_prompt(ckpt, x[0].tolist(), np.zeros((0, 64)), [])
    return llada_v_torch.logits(ckpt, embeds).numpy()


def _lavida_text(ckpt, x):
    """full_logits after a prompt of nothing: the forward without prefix_lm over the ids alone."""
    nothing = lavida_torch.load(ckpt)[4].model.embed_tokens(torch.zeros(1, 0, dtype=torch.long))
    return lavida_torch.full_logits(ckpt, nothing, x).numpy()


def _nemotron_vlm_text(ckpt, x):
    text = nemotron_vlm_ref.text_model(ckpt)
    embeds = nemotron_vlm_ref.embed_prompt(text, x, np.zeros((0, 1)), -1)
    return nemotron_vlm_ref.logits(text, x, embeds)


def _dimple_text(ckpt, x):
    with torch.no_grad():
        return dimple_torch.logits(ckpt, x).float().numpy()


# Fixture name -> (builder, the reference's plain forward over text ids (ckpt, ids) -> logits).
TEXT = {
    "llada_v": (build_llada_v, _llada_v_text),
    "lavida": (build_lavida, _lavida_text),
    "lavida_dream": (build_lavida_dream, _lavida_text),
    "nemotron_vlm": (nemotron_vlm_fixture.build, _nemotron_vlm_text),
    "dimple": (dimple_fixture.build, _dimple_text),
}


def _load(loader, ckpt):
    if loader == "mlx_vlm":
        import mlx_vlm

        return mlx_vlm.load(str(ckpt))[0]
    if loader == "mlx_lm":
        return load_fixture(ckpt)[0]
    from mlx_dllm_models import load

    return load(ckpt)[0]


@pytest.mark.parametrize("loader", ["package", "mlx_lm", "mlx_vlm"])
@pytest.mark.parametrize("name", sorted(TEXT))
def test_plain_call_over_text_is_the_references_forward(fixture_dir, name, loader):
    """Over text ids (across Nemotron's blocks of 8), through the package's load, mlx_lm.load and
    mlx_vlm.load (each builds the package's model): every key, as each upstream forward."""
    builder, reference = TEXT[name]
    ckpt = build_once(fixture_dir / name, builder)
    model = _load(loader, ckpt)
    x = ids(2 * nemotron_text_fixture.BLOCK_SIZE + 3, 29)
    got = plain(model, x)
    assert_close(got, reference(ckpt, x))
    assert far(got, causal(model, x))


LAVIDA = {"lavida": build_lavida, "lavida_dream": build_lavida_dream}


@pytest.fixture(scope="module", params=sorted(LAVIDA))
def lavida(request, fixture_dir):
    from mlx_dllm_models import load

    ckpt = build_once(fixture_dir / request.param, LAVIDA[request.param])
    return ckpt, *load(ckpt)


def test_lavida_plain_call_over_an_image_prompt_is_the_forward_without_prefix_lm(lavida):
    ckpt, model, processor = lavida
    image = random_picture(3, (90, 150))
    pixels, hw = processor.tiles(image)
    slots = model.image_slots(pixels, hw)
    before, after, answer = [72, 73], [105, 33], ids(8, 37)[0].tolist()
    features = lavida_torch.image_features(ckpt, pixels, image.size)[2]
    prompt = lavida_torch.embed_prompt(ckpt, before, features, after)
    want = lavida_torch.full_logits(ckpt, prompt, [answer]).numpy()
    x = np.array([before + slots + after + answer])
    got = plain(model, x)[:, -len(answer) :]
    assert_close(got, want)
    assert far(got, causal(model, x)[:, -len(answer) :])


# The families added since: SDAR-VL's language model is SDAR's (its eval forward reads the caller's
# mask; the plain call is its all-true reading, as SDAR's), Lumina-DiMOO's is LLaDA's (every key).
@pytest.mark.parametrize("length", [6, 11])
def test_sdar_v_plain_call_is_every_key(fixture_dir, length):
    from fixtures.sdar_v import build_sdar_v
    from mlx_dllm_models.masks import block_causal_mask
    from reference import sdar_v_torch

    ckpt = build_once(fixture_dir / "sdar_v", build_sdar_v)
    model = load_fixture(ckpt)[0]
    x = ids(length, 23)
    every = torch.ones(1, 1, length, length, dtype=torch.bool)
    want = sdar_v_torch.logits(ckpt, x, None, every).numpy()
    got = plain(model, x)
    assert_close(got, want)
    blocks = np.array(model(mx.array(x), mask=block_causal_mask(length, 4)).astype(mx.float32))
    assert far(got, blocks)


def test_lumina_dimoo_plain_call_is_every_key(fixture_dir):
    from fixtures.lumina_dimoo import build_lumina_dimoo
    from reference import llada_torch

    ckpt = build_once(fixture_dir / "lumina_dimoo", build_lumina_dimoo)
    model = load_fixture(ckpt)[0]
    x = ids(9, 29)
    got = plain(model, x)
    assert_close(got, llada_torch.reference_logits(ckpt, x))
    assert far(got, llada_torch.reference_logits(ckpt, x, causal=True))
