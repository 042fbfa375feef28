"""Nemotron-Labs-Diffusion-VLM's images through the public API: the processor (image_processing's
preprocessing against the reference's on a synthetic picture), generate_diffusion(image=),
batch_generate_diffusion(images=) (a different image, several, or none per row: each row equals its
run alone), self-speculation over an image prompt, `mlx_dllm generate --image`, one `serve`
request with an image_url data URL, and mlx_vlm.load / mlx_vlm.convert of the checkpoint."""

import numpy as np
import pytest
from PIL import Image

from fixtures import nemotron_vlm as fx
from helpers import (
    assert_image_reads_as_feature_ids,
    batch_equal_to_single_runs,
    checkpoint_fixtures,
    random_picture,
    served_image_answer,
    stream_tokens,
)
from mlx_dllm_models import load, stream_generate_diffusion
from mlx_dllm_models.models import nemotron_labs_diffusion_vlm as vlm_module
from reference import nemotron_vlm_torch as ref

SETTINGS = dict(max_tokens=16, block_length=8)


path, loaded = checkpoint_fixtures("nemotron_vlm", fx.build, name="path")


def picture(seed, size=(60, 90)):
    return random_picture(seed, size)


def smooth_picture(width, height):
    """A synthetic photo-like picture: gradients, a disc and a bar (jevons-rs's dump fixture)."""
    yy, xx = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [xx * 255 // (width - 1), yy * 255 // (height - 1), np.full_like(xx, 96)], -1
    ).astype(np.uint8)
    rgb[(xx - width * 0.3) ** 2 + (yy - height * 0.5) ** 2 < (height / 4) ** 2] = [220, 30, 30]
    rgb[height // 5 : height // 3, width // 2 : width - 20] = [30, 60, 220]
    return Image.fromarray(rgb)


@pytest.mark.parametrize("size", [(300, 200), (1900, 700), (500, 1500)])
def test_preprocessing_matches_encode_image_on_a_picture(size):
    """At the real 1400-pixel cap: no resize past the cap below it, the cap above it."""
    image = smooth_picture(*size)
    got, (w, h) = vlm_module.encode_image(image)
    w_ref, h_ref, want = ref.encode_image(image)
    assert (w, h) == (w_ref, h_ref) and got.shape == (1,) + want.shape
    np.testing.assert_allclose(got[0], want, atol=1e-5)


def test_processor_caps_images_at_the_towers_size(loaded):
    _, processor = loaded
    image = smooth_picture(300, 200)
    got, grid = processor.preprocess(image)
    w, h, want = ref.encode_image(image, max_edge=fx.VISION["image_size"])
    assert grid == (w, h) == (4, 3)
    np.testing.assert_allclose(got[0], want, atol=1e-5)


def test_generate_with_an_image_equals_the_prompt_of_feature_ids(loaded):
    model, processor = loaded
    assert_image_reads_as_feature_ids(model, processor, picture(2), picture(3), **SETTINGS)


def test_batch_rows_with_other_several_or_no_images_equal_single_runs(loaded):
    model, processor = loaded
    prompts = ["<image>What is it?", "<image> and <image>: which?", "No picture here", "<image>?"]
    images = [picture(4), [picture(5), picture(6, (30, 30))], None, picture(7, (100, 40))]
    batch_equal_to_single_runs(model, processor, prompts, images=images, **SETTINGS)


def test_self_speculation_over_an_image_prompt_is_greedy_ar(loaded):
    """mode="self_spec" is lossless: the greedy AR tokens (each a causal forward over the prompt
    with its image and the tokens so far)."""
    import mlx.core as mx

    model, processor = loaded
    ids = processor(text=["<image>Say it"], images=[picture(8)])["input_ids"][0]
    got = stream_tokens(model, processor, ids, mode="self_spec", max_tokens=12, block_length=4)
    want = []
    while len(want) < 12:
        logits = model(mx.array([ids + want]), mask="causal")
        token = int(mx.argmax(logits[0, -1]).item())
        if token == fx.text.EOS:
            break
        want.append(token)
    assert got == want and len(want) > 4


def test_cli_generate_with_an_image(loaded, path, tmp_path, capsys):
    """mlx_dllm generate --image prints the text of generate_diffusion on the chat prompt."""
    from mlx_dllm_models import generate_diffusion
    from mlx_dllm_models.cli import main as cli_main
    from mlx_dllm_models.vision import text_tokenizer

    model, processor = loaded
    file = tmp_path / "picture.png"
    picture(10).save(file)
    args = ["generate", "--model", str(path), "--prompt", "<image>describe", "--no-live"]
    flags = ["--max-tokens", "16", "--block-length", "8"]
    assert cli_main(args + ["--image", str(file)] + flags) == 0
    out = capsys.readouterr().out
    messages = [{"role": "user", "content": "<image>describe"}]
    prompt = text_tokenizer(processor).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    want = generate_diffusion(model, processor, prompt, image=str(file), **SETTINGS)
    assert want.strip() and want in out


def test_serve_answers_an_image_url_part(loaded, path):
    """The chat endpoint with an image_url data URL answers the text of one generate call on the
    chat prompt with the image where the part was."""

    from mlx_dllm_models.vision import text_tokenizer

    model, processor = loaded
    answer = served_image_answer(path, "nemotron-vlm", picture(9), "x", **SETTINGS)
    messages = [{"role": "user", "content": "<image>x"}]
    prompt = text_tokenizer(processor).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    runs = stream_generate_diffusion(model, processor, prompt, image=[picture(9)], **SETTINGS)
    want = "".join(r.text for r in runs)
    assert want and answer == want


def test_mlx_vlm_load_and_convert_handle_the_checkpoint(loaded, path, tmp_path):
    """mlx_vlm.models.nemotron_labs_diffusion_vlm resolves to this package's module (the import
    hook): mlx_vlm.load builds this model with the same logits, and mlx_vlm.convert writes a
    checkpoint that answers an image prompt with the same tokens."""
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.convert import convert

    model, processor = loaded
    image = picture(11)
    want = stream_tokens(model, processor, "<image>hi", image=image, **SETTINGS)

    vlm_model, _ = mlx_vlm.load(str(path))
    assert isinstance(vlm_model, vlm_module.Model)
    pixels = processor.preprocess(image)[0]
    logits = [
        np.array(m(mx.array([[300, 72] + m.image_slots(pixels) + [310, 310]])))
        for m in (vlm_model, model)
    ]
    assert np.array_equal(*logits)

    # The fixture names remote code in auto_map but ships none (the real checkpoint ships it).
    convert(str(path), mlx_path=str(tmp_path / "vlm"), trust_remote_code=False)
    converted, converted_processor = load(tmp_path / "vlm")
    got = stream_tokens(converted, converted_processor, "<image>hi", image=image, **SETTINGS)
    assert got == want
