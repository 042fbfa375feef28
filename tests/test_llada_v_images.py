"""LLaDA-V's images through the public API: the processor (SigLIP preprocessing against the
reference's, `<image>` placement), generate_diffusion(image=) and batch_generate_diffusion(images=)
(a different image, several, or none per row: each row equals its run alone)."""

import numpy as np
import pytest
from PIL import Image

from fixtures import build_once
from fixtures.llada_v import TILE, build_llada_v
from helpers import (
    assert_image_reads_as_feature_ids,
    batch_equal_to_single_runs,
    random_picture,
    served_image_answer,
    step_to_the_end,
    stream_tokens,
)
from mlx_dllm_models import load, stream_generate_diffusion
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.vision import ImageError

SETTINGS = dict(max_tokens=16, block_length=8, steps=4)


@pytest.fixture(scope="module")
def loaded(fixture_dir):
    return load(build_once(fixture_dir / "llada_v", build_llada_v))


def picture(seed, size=(40, 70)):
    return random_picture(seed, size)


def reference_preprocess(image, size):
    """SigLipImageProcessor.preprocess (LLaDA-V's siglip_encoder.py): RGB, bicubic resize to
    size x size, x / 255, (x - 0.5) / 0.5, channels first; written with PIL and numpy alone."""
    x = np.asarray(image.convert("RGB").resize((size, size), Image.BICUBIC), dtype=np.float64)
    x = (x / 255 - 0.5) / 0.5
    return x.transpose(2, 0, 1)[None]


def test_preprocessing_matches_the_reference_on_a_real_photo(loaded):
    datasets = pytest.importorskip("sklearn.datasets")
    photo = Image.fromarray(datasets.load_sample_image("china.jpg"))  # 640 x 427
    _, processor = loaded
    for size in (TILE, 384):
        processor.size = size
        got = processor.preprocess(photo)
        assert got.shape == (1, 3, size, size) and got.dtype == np.float32
        np.testing.assert_allclose(got, reference_preprocess(photo, size), atol=1e-5)
    processor.size = TILE


def test_processor_puts_each_images_features_at_its_placeholder(loaded):
    model, processor = loaded
    out = processor(text=["ab<image>cd<image>e"], images=[picture(0), picture(1)])
    ids = out["input_ids"][0]
    assert out["pixel_values"] is None
    tok = processor.tokenizer
    # anyres: the base tile's 16 features, then the unpadded tiles' rows, each closed by a newline.
    n = model.image_features(*processor.tiles(picture(0))).shape[0]
    assert n > (TILE // 14) ** 2 + 1
    image_ids = [t for t in ids if model.is_image_id(t)]
    assert len(image_ids) == 2 * n
    text = [t for t in ids if not model.is_image_id(t)]
    assert text == tok.encode("ab") + tok.encode("cd", add_special_tokens=False) + tok.encode(
        "e", add_special_tokens=False
    )
    first = ids.index(image_ids[0])
    assert ids[first + n : first + n + 2] == tok.encode("cd", add_special_tokens=False)
    with pytest.raises(ValueError, match="1 <image> placeholders for 2 images"):
        processor(text=["a<image>b"], images=[picture(0), picture(1)])


def test_generate_with_an_image_equals_the_prompt_of_feature_ids(loaded):
    model, processor = loaded
    assert_image_reads_as_feature_ids(model, processor, picture(2), picture(3), **SETTINGS)


@pytest.mark.slow
def test_batch_rows_with_other_several_or_no_images_equal_single_runs(loaded):
    model, processor = loaded
    prompts = ["<image>What is it?", "<image> and <image>: which?", "No picture here", "<image>?"]
    images = [picture(4), [picture(5), picture(6)], None, picture(7, size=(90, 30))]
    batch_equal_to_single_runs(model, processor, prompts, images=images, **SETTINGS)


def test_bad_images_are_clear_errors(loaded, tmp_path):
    model, processor = loaded
    with pytest.raises(ImageError, match="does not exist"):
        stream_tokens(model, processor, "<image>hi", image=str(tmp_path / "none.png"), **SETTINGS)
    with pytest.raises(SettingsError, match="outside the vocabulary"):
        stream_tokens(model, processor, [1, 2, -5], **SETTINGS)


@pytest.mark.slow
def test_serve_answers_image_url_parts_and_batches_image_rows(loaded, fixture_dir):
    """The chat endpoint with an image_url data URL answers the tokens of one generate call on the
    chat prompt with the image where the part was; the scheduler batches image and text rows, each
    equal to its run alone."""

    from mlx_dllm_models.server import Job, Scheduler
    from mlx_dllm_models.vision import text_tokenizer

    model, processor = loaded

    def chat(content):
        messages = [{"role": "user", "content": content}]
        tok = text_tokenizer(processor)
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    scheduler = Scheduler(model, processor)
    cases = [
        (chat("<image>describe"), [picture(8)]),
        (chat("describe"), None),
        (chat("<image>describe"), [picture(9)]),
    ]
    jobs = [scheduler.submit(Job(p, dict(SETTINGS), images=im)) for p, im in cases]
    step_to_the_end(scheduler, 50)
    assert scheduler.max_rows == 3 and all(j.done for j in jobs)
    for job, (p, im) in zip(jobs, cases):
        assert job.tokens == stream_tokens(model, processor, p, image=im, **SETTINGS)

    path = fixture_dir / "llada_v"
    text = served_image_answer(path, "llada-v", picture(8), "x", **SETTINGS)
    runs = stream_generate_diffusion(
        model, processor, chat("<image>x"), image=[picture(8)], **SETTINGS
    )
    want = "".join(r.text for r in runs)
    assert want and text == want


def photo():
    datasets = pytest.importorskip("sklearn.datasets")
    return Image.fromarray(datasets.load_sample_image("china.jpg"))  # 640 x 427


@pytest.mark.slow
@pytest.mark.parametrize("size", [TILE, 384])
def test_anyres_tiles_match_process_anyres_image_on_a_real_photo(size):
    """LLaDA-V's pinpoints (1x1 ... 6x6 tiles) at the real tile (384) and the fixture's."""
    from mlx_dllm_models.models.llava_llada import anyres_tiles
    from reference.llada_v_torch import process_anyres_image

    pins = [[size * i, size * j] for i in range(1, 7) for j in range(1, 7)]
    for image in (photo(), photo().transpose(Image.Transpose.ROTATE_90), picture(1, (50, 300))):
        got, hw = anyres_tiles(image, size, pins)
        want = process_anyres_image(image, size, pins)
        assert hw == (image.size[1], image.size[0])
        assert got.shape == want.shape
        assert got.shape[0] > 2 or max(image.size) <= size  # a photo takes several tiles
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("shape", [(40, 70), (150, 60), (160, 160), (427, 640)])
def test_anyres_image_features_match_the_reference_packing(loaded, fixture_dir, shape):
    """Tiles through the tower, unpadded, downsampled past anyres_max_4 and closed by
    image_newline per row, after the base tile: mlx-vlm's packing against llava_arch's."""
    from helpers import assert_close
    from reference.llada_v_torch import anyres_image_features

    model, processor = loaded
    image = photo().resize((shape[1], shape[0])) if shape == (427, 640) else picture(2, shape)
    pixels, hw = processor.tiles(image)
    got = np.array(model.image_features(pixels, hw))
    want = anyres_image_features(fixture_dir / "llada_v", pixels, image.size)
    assert got.shape == want.shape
    assert_close(got, want)


@pytest.mark.slow
def test_plain_mlx_lm_convert_keeps_the_vision_path(loaded, fixture_dir, tmp_path):
    """python -m mlx_lm convert of the HF checkpoint loads back (its vision weights already in
    mlx's layout) and answers an image prompt with the same tokens."""
    from helpers import mlx_lm_convert

    model, processor = loaded
    out = mlx_lm_convert(fixture_dir / "llada_v", tmp_path / "converted")
    converted, converted_processor = load(out)
    image = picture(6)
    want = stream_tokens(model, processor, "<image>hi", image=image, **SETTINGS)
    got = stream_tokens(converted, converted_processor, "<image>hi", image=image, **SETTINGS)
    assert got == want


def test_cli_generate_with_an_image(loaded, fixture_dir, tmp_path, capsys):
    """mlx_dllm generate --image prints the text of generate_diffusion on the chat prompt."""
    from mlx_dllm_models import generate_diffusion
    from mlx_dllm_models.cli import main as cli_main
    from mlx_dllm_models.vision import text_tokenizer

    model, processor = loaded
    path = tmp_path / "picture.png"
    picture(10).save(path)
    args = ["generate", "--model", str(fixture_dir / "llada_v"), "--prompt", "<image>describe"]
    flags = ["--max-tokens", "16", "--block-length", "8", "--steps", "4", "--no-live"]
    assert cli_main(args + ["--image", str(path)] + flags) == 0
    out = capsys.readouterr().out
    messages = [{"role": "user", "content": "<image>describe"}]
    prompt = text_tokenizer(processor).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    want = generate_diffusion(model, processor, prompt, image=str(path), **SETTINGS)
    assert want.strip() and want in out
    with pytest.raises(SystemExit, match="does not exist"):
        cli_main(args + ["--image", str(tmp_path / "missing.png")] + flags)


def test_mlx_lm_and_mlx_vlm_load_and_mlx_vlm_convert_handle_the_checkpoint(
    loaded, fixture_dir, tmp_path
):
    """mlx_vlm.models.llava_llada resolves to this package's module (the import hook), so
    mlx_vlm.load builds the same model and mlx_vlm.convert writes a checkpoint that decodes the same
    tokens; mlx_lm.load's bare tokenizer takes images too (the processor is built on it)."""
    import mlx.core as mx
    import mlx_lm
    import mlx_vlm
    from mlx_vlm.convert import convert

    from mlx_dllm_models.models.llava_llada import Model

    model, processor = loaded
    path = fixture_dir / "llada_v"
    image = picture(11)
    want = stream_tokens(model, processor, "<image>hi", image=image, **SETTINGS)

    lm_model, tokenizer = mlx_lm.load(str(path))
    assert stream_tokens(lm_model, tokenizer, "<image>hi", image=image, **SETTINGS) == want

    vlm_model, _ = mlx_vlm.load(str(path))
    assert isinstance(vlm_model, Model)
    # Each model keeps its own image features: each prompt holds its own model's image ids.
    logits = [
        np.array(m(mx.array([[300, 72] + m.image_slots(*processor.tiles(image)) + [310, 310]])))
        for m in (vlm_model, model)
    ]
    assert np.array_equal(*logits)

    convert(str(path), mlx_path=str(tmp_path / "vlm"))
    converted, converted_processor = load(tmp_path / "vlm")
    assert stream_tokens(converted, converted_processor, "<image>hi", image=image, **SETTINGS) == (
        want
    )
