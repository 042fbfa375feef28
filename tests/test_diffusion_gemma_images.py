"""DiffusionGemma with images, through mlx-vlm's Gemma 4 vision tower and processor.

Parity: transformers' own generate, given the same image (as patches, by transformers' own
patchifier) and the same shared random draws, takes the same steps as the engine. The image's soft
tokens sit where the prompt holds the image token, and a run of image tokens attends to itself both
ways in the encoder (use_bidirectional_attention="vision").
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import diffusion_gemma_checks as checks
from diffusion_gemma_checks import C, gemma_fixtures
from fixtures import diffusion_gemma as fx
from helpers import mlx_lm_convert
from mlx_dllm_models import batch_generate_diffusion, generate_diffusion, load
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.vision import ImageError, encode_prompt

SETTINGS = dict(max_denoising_steps=8, stability_threshold=0, confidence_threshold=0.2)
EOS = [fx.VOCAB - 1]

checkpoint, dg, reference, eos_ids = gemma_fixtures()


def picture(seed, size=fx.IMAGE_SIZE):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def image_prompt(dg):
    _, processor = dg
    prompt = "<bos>Look: <|image|> what is it?"
    return encode_prompt(processor, prompt, [picture(0)], add_special_tokens=False)


def test_processor_places_boi_soft_tokens_eoi_from_a_pil_image(image_prompt):
    ids, pixel_values = image_prompt
    start = ids.index(fx.BOI)
    assert ids[start : start + fx.IMAGE_SOFT_TOKENS + 2] == (
        [fx.BOI] + [fx.IMAGE] * fx.IMAGE_SOFT_TOKENS + [fx.EOI]
    )
    assert ids.count(fx.IMAGE) == fx.IMAGE_SOFT_TOKENS and ids[0] == fx.BOS
    assert tuple(pixel_values.shape) == (1, 3, fx.IMAGE_SIZE, fx.IMAGE_SIZE)


def _transformers_image_inputs(ids, pixel_values):
    """The same image as transformers' Gemma 4 processor hands it over: patches and positions."""
    import torch
    from transformers.models.gemma4.image_processing_pil_gemma4 import convert_image_to_patches

    p = fx.VISION_CONFIG["patch_size"]
    image = np.array(pixel_values)[0]
    patches = convert_image_to_patches(image, p)
    width, height = image.shape[2] // p, image.shape[1] // p
    grid_x, grid_y = np.meshgrid(np.arange(width), np.arange(height), indexing="xy")
    positions = np.stack([grid_x, grid_y], axis=-1).reshape(-1, 2)
    return dict(
        pixel_values=torch.tensor(patches[None]),
        image_position_ids=torch.tensor(positions[None]),
        mm_token_type_ids=torch.tensor([[int(t == fx.IMAGE) for t in ids]]),
    )


@pytest.fixture(scope="module")
def image_parity(dg, reference, image_prompt):
    ids, pixel_values = image_prompt
    draws = checks.Draws(4, 2, SETTINGS["max_denoising_steps"])
    ours = checks.run_engine(dg[0], ids, draws, EOS, images=[pixel_values], **SETTINGS)
    mp = pytest.MonkeyPatch()
    theirs = checks.run_transformers(
        reference, ids, draws, EOS, mp, **SETTINGS, **_transformers_image_inputs(ids, pixel_values)
    )
    return draws, ours, theirs


def _worst(ours, theirs):
    return max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(ours, theirs))


@pytest.mark.slow
def test_image_generation_matches_transformers_step_by_step(image_parity):
    _, (rec, tokens, _), (ref_rec, ref_tokens) = image_parity
    checks.assert_same_steps(rec, ref_rec)
    assert tokens == checks.until_eos(ref_tokens, EOS) and len(tokens) == 2 * C
    assert _worst(rec["processed"], ref_rec["processed"]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["image_tokens_causal", "features_one_token_late"])
def test_the_image_parity_check_catches_mistakes(
    dg, image_prompt, image_parity, mistake, monkeypatch
):
    import mlx_dllm_models.vision as vision

    model = dg[0]
    ids, pixel_values = image_prompt
    draws, _, (ref_rec, _) = image_parity
    if mistake == "image_tokens_causal":
        monkeypatch.setattr(model.model, "bidirectional_vision", False)
    else:
        real = vision.place_features

        def late(h, inputs, features, token):
            shifted = mx.concatenate([inputs[:, -1:], inputs[:, :-1]], axis=1)
            return real(h, shifted, features, token)

        monkeypatch.setattr(vision, "place_features", late)
    rec, _, _ = checks.run_engine(model, ids, draws, EOS, images=[pixel_values], **SETTINGS)
    monkeypatch.undo()
    assert _worst(rec["processed"][:1], ref_rec["processed"][:1]) > 1e-3


def _generate(model, tok, prompt, **kw):
    return generate_diffusion(model, tok, prompt, max_tokens=C, max_denoising_steps=4, **kw)


def test_the_image_changes_the_output(dg, eos_ids):
    model, processor = dg
    first = _generate(model, processor, "describe", image=[picture(1)])
    other = _generate(model, processor, "describe", image=[picture(2)])
    none = _generate(model, processor, "describe")
    assert first != other and first != none and other != none
    assert first == _generate(model, processor, "describe", image=picture(1))


@pytest.mark.slow
def test_image_from_a_path_equals_the_pil_image(dg, eos_ids, tmp_path):
    model, processor = dg
    path = tmp_path / "picture.png"
    picture(3).save(path)
    assert _generate(model, processor, "what?", image=[str(path)]) == _generate(
        model, processor, "what?", image=[picture(3)]
    )
    two = "<|image|> and <|image|>"
    assert _generate(model, processor, two, image=[path, picture(4)]) == _generate(
        model, processor, two, image=[picture(3), picture(4)]
    )


@pytest.fixture(scope="module")
def text_only(checkpoint, tmp_path_factory):
    """The same checkpoint without vision_config: mlx-lm drops the vision weights."""
    path = tmp_path_factory.mktemp("dg_text") / "ckpt"
    shutil.copytree(checkpoint, path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["vision_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_text_only_checkpoint_rejects_images_clearly(text_only, dg):
    model, tokenizer = load(text_only)
    assert model.vision_tower is None and not hasattr(tokenizer, "image_processor")
    with pytest.raises(SettingsError, match="no vision tower"):
        generate_diffusion(model, tokenizer, "describe", image=[picture(0)], max_tokens=4)
    with pytest.raises(ValueError, match="no vision tower"):
        pixels = mx.zeros((1, 3, 16, 16))
        model.encode(mx.array([[fx.BOS, fx.IMAGE]]), model.make_cache(), pixel_values=pixels)
    kw = dict(max_tokens=4, max_denoising_steps=2)
    # Without images the vision weights play no part: the text is the full checkpoint's.
    assert generate_diffusion(model, tokenizer, "describe", **kw) == generate_diffusion(
        *dg, "describe", **kw
    )


@pytest.mark.parametrize(
    "prompt, image, message",
    [
        ("hi", ["/nonexistent/picture.png"], "does not exist"),
        ("hi", ["NOT_AN_IMAGE"], "could not read image"),
        ("<|image|><|image|> two?", [None], "placeholders"),
        ("hi", [], "empty list"),
        ("hi", [3.5], "must be a file path, a PIL image or a uint8 array"),
    ],
)
def test_bad_images_are_clear_errors(dg, tmp_path, prompt, image, message):
    model, processor = dg
    bad = tmp_path / "not_an_image.png"
    bad.write_text("plain text")
    image = [str(bad) if i == "NOT_AN_IMAGE" else picture(0) if i is None else i for i in image]
    with pytest.raises(ImageError, match=message):
        generate_diffusion(model, processor, prompt, image=image, max_tokens=4)


def test_images_need_the_processor_and_one_text_prompt(dg, checkpoint):
    model, processor = dg
    from mlx_lm.utils import load as mlx_load

    _, tokenizer = mlx_load(str(checkpoint))
    with pytest.raises(SettingsError, match="need the processor"):
        generate_diffusion(model, tokenizer, "hi", image=[picture(0)], max_tokens=4)
    with pytest.raises(SettingsError, match="has images, so it must be text"):
        generate_diffusion(model, processor, [fx.BOS, 65], image=[picture(0)], max_tokens=4)
    with pytest.raises(SettingsError, match="images has 1 entries for 2 prompts"):
        batch_generate_diffusion(model, processor, ["a", "b"], images=[picture(0)], max_tokens=4)
    with pytest.raises(SettingsError, match="one entry per prompt"):
        batch_generate_diffusion(model, processor, ["a", "b"], images=picture(0), max_tokens=4)


@pytest.mark.slow
def test_batched_image_prompts_equal_single_runs(dg):
    """A different image (or none, or two) per row, rows of different lengths (left padding), a
    token-id row: each row's tokens equal its run alone (DiffusionGemma samples on a schedule;
    each row draws the noise it draws alone from the seed)."""
    model, processor = dg
    prompts = ["describe", "<|image|> and <|image|>, which?", "describe", [fx.BOS, 70, 71, 72]]
    images = [picture(1), [picture(2), picture(3)], None, None]
    settings = dict(max_tokens=2 * C, max_denoising_steps=3, seed=4)
    batch = batch_generate_diffusion(model, processor, prompts, images=images, **settings)
    alone = [
        batch_generate_diffusion(model, processor, [p], images=[i], **settings)
        for p, i in zip(prompts, images)
    ]
    assert batch.tokens == [a.tokens[0] for a in alone]
    assert batch.finish_reasons == [a.finish_reasons[0] for a in alone]
    # The images matter: the image rows differ from the same prompt without them.
    assert batch.tokens[0] != batch.tokens[2]
    assert all(len(t) > 0 for t in batch.tokens)


def test_cli_image(checkpoint, tmp_path, capsys):
    path = tmp_path / "picture.png"
    picture(5).save(path)
    args = [
        "generate",
        "--model",
        str(checkpoint),
        "--prompt",
        "describe",
        "--image",
        str(path),
        "--image",
        str(path),
        "--max-tokens",
        "8",
        "--max-denoising-steps",
        "2",
        "--no-live",
    ]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "NFE: 2" in out
    with pytest.raises(SystemExit, match="does not exist"):
        cli_main(args[:5] + ["--image", str(tmp_path / "missing.png")] + args[9:])


@pytest.mark.slow
def test_converted_checkpoint_keeps_the_vision_tower(checkpoint, tmp_path):
    """mlx-lm's convert keeps vision_config and the tower's weights (unquantized); without
    processor_config.json the processor takes patch size and pooling from the tower's config."""
    out = mlx_lm_convert(checkpoint, tmp_path / "q4", "-q", "--q-bits", "4")
    cfg = json.loads((out / "config.json").read_text())
    assert "vision_config" in cfg
    assert not any(k.startswith("model.vision_tower") for k in cfg["quantization"])
    model, processor = load(out)
    assert model.vision_tower is not None
    assert processor.image_processor.patch_size == fx.VISION_CONFIG["patch_size"]
    assert processor.image_processor.pooling_kernel_size == fx.VISION_CONFIG["pooling_kernel_size"]
    text = generate_diffusion(
        model, processor, "describe", image=[picture(6)], max_tokens=8, max_denoising_steps=2
    )
    assert isinstance(text, str)
