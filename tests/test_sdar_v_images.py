"""SDAR-VL's images through the public API and the tools: generate with an image equals the prompt
of its feature ids, batch rows (other, several or no images) equal their single runs, a chat request
with an image through `mlx_dllm serve`, sharding over one rank, and plain mlx-lm / mlx-vlm load and
convert."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures.sdar_v import build_sdar_v
from helpers import (
    assert_one_rank_keeps_logits_and_three_are_refused,
    batch_equal_to_single_runs,
    checkpoint_fixtures,
    random_picture,
    served_image_answer,
    stream_tokens,
)
from mlx_dllm_models import load, stream_generate_diffusion

SETTINGS = dict(max_tokens=12)
PAD = "<|image_pad|>"


path, loaded = checkpoint_fixtures("sdar_v", build_sdar_v, name="path")


def picture(seed, size=(40, 70)):
    return random_picture(seed, size)


def chat(processor, *parts):
    """The checkpoint's chat template over one user message of `parts` (text, or None: an
    image)."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_generate_with_an_image_equals_the_prompt_of_feature_ids(loaded):
    model, processor = loaded
    text = chat(processor, None, "What is it?")
    assert text.count(PAD) == 1
    got = stream_tokens(model, processor, text, image=picture(2), **SETTINGS)
    ids = processor(text=[text], images=[picture(2)])["input_ids"][0]
    assert got and got == stream_tokens(model, processor, ids, **SETTINGS)
    assert stream_tokens(model, processor, text, image=picture(3), **SETTINGS) != got


@pytest.mark.slow
def test_batch_rows_with_other_several_or_no_images_equal_single_runs(loaded):
    model, processor = loaded
    prompts = [
        chat(processor, None, "What is it?"),
        chat(processor, None, "and", None, "which?"),
        chat(processor, "No picture here"),
        chat(processor, "?", None),
    ]
    images = [picture(4), [picture(5), picture(6)], None, picture(7, size=(90, 30))]
    batch_equal_to_single_runs(model, processor, prompts, images=images, **SETTINGS)


def test_one_rank_keeps_the_logits(loaded):
    model, _ = loaded
    ids = [257, 72, 105] + model.image_slots(np.zeros((1, 3, 56, 56), np.float32)) + [261] * 4
    assert_one_rank_keeps_logits_and_three_are_refused(model, mx.array([ids]))


@pytest.mark.slow
def test_serve_answers_an_image_url_part(loaded, path):
    """The chat endpoint with an image_url data URL answers what the stream gives for the chat
    template's prompt with the image where the part was. The server hands the template the
    message's parts joined into one string (the image as its token), which this template renders
    after "\n\n" where a list of parts gets "\n"."""
    model, processor = loaded
    text = served_image_answer(path, "sdar-vl", picture(8), "x", **SETTINGS)
    messages = [{"role": "user", "content": PAD + "x"}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    runs = stream_generate_diffusion(model, processor, prompt, image=[picture(8)], **SETTINGS)
    want = "".join(r.text for r in runs)
    assert want and text == want


@pytest.mark.slow
def test_mlx_lm_and_mlx_vlm_load_and_convert_handle_the_checkpoint(loaded, path, tmp_path):
    """mlx_vlm.models.sdar_v resolves to this package's module (the import hook): mlx_vlm.load
    builds the same model and mlx_vlm.convert, like plain mlx_lm convert, writes a checkpoint that
    decodes the same tokens; mlx_lm.load's bare tokenizer takes images too."""
    import mlx_lm
    import mlx_vlm
    from mlx_vlm.convert import convert

    from helpers import mlx_lm_convert
    from mlx_dllm_models.models.sdar_v import Model

    model, processor = loaded
    image = picture(11)
    prompt = chat(processor, None, "hi")
    want = stream_tokens(model, processor, prompt, image=image, **SETTINGS)
    assert want

    lm_model, tokenizer = mlx_lm.load(str(path))
    assert stream_tokens(lm_model, tokenizer, prompt, image=image, **SETTINGS) == want

    vlm_model, _ = mlx_vlm.load(str(path))
    assert isinstance(vlm_model, Model)
    logits = [
        np.array(m(mx.array([[257, 72] + m.image_slots(*processor.preprocess(image)) + [261]])))
        for m in (vlm_model, model)
    ]
    assert np.array_equal(*logits)

    convert(str(path), mlx_path=str(tmp_path / "vlm"))
    out = mlx_lm_convert(path, tmp_path / "lm")
    for folder in (tmp_path / "vlm", out):
        converted, converted_processor = load(folder)
        got = stream_tokens(converted, converted_processor, prompt, image=image, **SETTINGS)
        assert got == want


@pytest.mark.parametrize("size", [(40, 70), (150, 60), (56, 56), (300, 20), (500, 480)])
def test_prompt_ids_equal_llava_onevision_processors_with_image_pads(loaded, size):
    """transformers' LlavaOnevisionProcessor (what the checkpoint's processor_config.json names)
    repeats `<|image_pad|>` once per feature it counts for the image (`_get_number_of_features`;
    the processor itself is built without its video processor, which needs torchvision): this
    processor's ids are that prompt with a feature id at each of those places."""
    from transformers import LlavaOnevisionProcessor

    model, processor = loaded
    tower = model.onevision.vision_config
    counter = object.__new__(LlavaOnevisionProcessor)
    counter.image_processor = processor.images
    counter.num_image_tokens = (tower.image_size // tower.patch_size) ** 2
    counter.vision_feature_select_strategy = "full"
    counter.vision_aspect_ratio = model.args.vision_aspect_ratio
    image = picture(12, size)
    count = counter._get_number_of_features(*size, tower.image_size, tower.image_size)
    text = chat(processor, "look:", None, "what is it?")
    want = processor.tokenizer.encode(text.replace(PAD, PAD * count), add_special_tokens=False)
    got = processor(text=[text], images=[image])["input_ids"][0]
    pad = model.args.image_token_index
    assert [pad if t >= model.args.vocab_size else t for t in got] == want
    assert count > counter.num_image_tokens


def test_a_transformers_processor_gives_way_to_the_models_own(loaded):
    """Where torchvision is installed, mlx_vlm.load builds the LlavaOnevisionProcessor the
    checkpoint's processor_config.json names; the model's processor (feature ids, not image
    tokens) takes its place, around its tokenizer."""
    from mlx_dllm_models.vision import model_processor

    model, processor = loaded

    class TransformersProcessor:
        image_processor = processor.images
        tokenizer = processor.tokenizer

    got = model_processor(model, TransformersProcessor())
    assert type(got) is type(processor) and got.model is model
    assert model_processor(model, processor) is processor
