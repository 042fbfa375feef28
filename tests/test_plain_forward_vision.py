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
* Dimple: its text forward is held in tests/test_plain_forward.py and its image forward in
  tests/test_dimple.py (test_logits_over_an_image_prompt_match_reference, a plain call); the image
  forwards of LLaDA-V and Nemotron-VLM are likewise plain calls in their families' files, and are
  repeated here only where the reading differs (LaViDa's image prompt without the prefix layout).
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures import diffusion_gemma as gemma_fixture
from fixtures import nemotron as nemotron_text_fixture
from fixtures import nemotron_vlm as nemotron_vlm_fixture
from fixtures.lavida import build_lavida, build_lavida_dream
from fixtures.llada_v import build_llada_v
from helpers import assert_close, far, load_fixture, random_picture
from mlx_dllm_models.masks import causal_mask
from reference import lavida_torch, llada_v_torch
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


@pytest.fixture(scope="module")
def llada_v(fixture_dir):
    ckpt = build_once(fixture_dir / "llada_v", build_llada_v)
    return ckpt, load_fixture(ckpt)[0]


def test_llada_v_plain_call_over_text_attends_to_every_key(llada_v):
    ckpt, model = llada_v
    x = ids(12, 29)
    embeds = llada_v_torch.embed_prompt(ckpt, x[0].tolist(), np.zeros((0, 64)), [])
    want = llada_v_torch.logits(ckpt, embeds).numpy()
    got = plain(model, x)
    assert_close(got, want)
    assert far(got, causal(model, x))


LAVIDA = {"lavida": build_lavida, "lavida_dream": build_lavida_dream}


@pytest.fixture(scope="module", params=sorted(LAVIDA))
def lavida(request, fixture_dir):
    from mlx_dllm_models import load

    ckpt = build_once(fixture_dir / request.param, LAVIDA[request.param])
    return ckpt, *load(ckpt)


def _no_embeds(ckpt):
    """(1, 0, hidden): a prompt of nothing, so that full_logits reads the ids alone."""
    return lavida_torch.load(ckpt)[4].model.embed_tokens(torch.zeros(1, 0, dtype=torch.long))


def test_lavida_plain_call_over_text_attends_to_every_key(lavida):
    ckpt, model, _ = lavida
    x = ids(12, 31)
    want = lavida_torch.full_logits(ckpt, _no_embeds(ckpt), x).numpy()
    got = plain(model, x)
    assert_close(got, want)
    assert far(got, causal(model, x))


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


def test_nemotron_vlm_plain_call_over_text_is_its_default_bidirectional_forward(fixture_dir):
    ckpt = build_once(fixture_dir / "nemotron_vlm", nemotron_vlm_fixture.build)
    model = load_fixture(ckpt)[0]
    text = nemotron_vlm_ref.text_model(ckpt)
    x = ids(2 * nemotron_text_fixture.BLOCK_SIZE + 3, 41)
    embeds = nemotron_vlm_ref.embed_prompt(text, x, np.zeros((0, 1)), -1)
    got = plain(model, x)
    assert_close(got, nemotron_vlm_ref.logits(text, x, embeds))
    assert far(got, nemotron_vlm_ref.logits(text, x, embeds, causal=True))
