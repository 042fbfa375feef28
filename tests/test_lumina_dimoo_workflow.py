"""Lumina-DiMOO as a checkpoint and through the CLI and the server: it loads as model_type "llada"
(its class subclasses LLaDAModelLM) with LLaDA 8B's text logits, plain `python -m mlx_lm convert`
keeps its `vqvae/` folder and image, `mlx_dllm generate --image-out` writes a PNG of the asked
size in a fresh process, and `/v1/images/generations` returns one (openai client); an image alone is edited by the CLI and by
`/v1/images/edits`."""

import base64
import io

import mlx.core as mx
import numpy as np
import openai
import pytest
from openai import OpenAI
from PIL import Image

from fixtures.lumina_dimoo import VOCAB, build_lumina_dimoo
from helpers import checkpoint_fixtures, convert_and_generate, run_cli, serving
from image_checks import cli_writes_a_png
from mlx_dllm_models import load
from mlx_dllm_models.images import generate_image
from reference.llada_torch import reference_logits

ckpt, loaded = checkpoint_fixtures("lumina_dimoo", build_lumina_dimoo)


@pytest.mark.slow
def test_loads_as_llada_with_the_image_spec_and_llada_8bs_text_logits(ckpt, loaded):
    model, tok = loaded
    assert type(model).__module__ == "mlx_dllm_models.models.llada"
    assert model.image_spec.family == "lumina_dimoo"
    ids = np.array([tok.encode("hello <|mdm_mask|><|mdm_mask|> world")], dtype=np.int64)
    got = np.array(model(mx.array(ids)))
    assert got.shape[-1] == VOCAB
    np.testing.assert_allclose(got, reference_logits(ckpt, ids), atol=1e-4, rtol=1e-4)


def test_plain_llada_has_no_image_spec(fixture_dir):
    from fixtures import build_once
    from fixtures.llada import build_llada

    model, _ = load(str(build_once(fixture_dir / "llada", build_llada)))
    assert model.image_spec is None


@pytest.mark.slow
def test_mlx_lm_convert_keeps_the_vqvae_and_the_image(ckpt, loaded, tmp_path):
    out = tmp_path / "converted"
    run = convert_and_generate(ckpt, out, ["hello"], max_tokens=8, seed=0)
    assert run["module"] == "mlx_dllm_models.models.llada" and len(run["tokens"][0]) > 0
    assert run["config"]["architectures"] == ["LLaDAForMultiModalGeneration"]
    assert (out / "vqvae" / "config.json").is_file()
    kw = dict(width=16, height=8, steps=3, seed=2)
    source = generate_image(*loaded, "a red cat", **kw)
    converted = generate_image(*load(str(out)), "a red cat", **kw)
    np.testing.assert_array_equal(np.asarray(converted), np.asarray(source))


@pytest.mark.slow
def test_cli_writes_a_png_of_the_requested_size(ckpt, tmp_path):
    cli_writes_a_png(ckpt, tmp_path / "out.png")
    photo(16).save(tmp_path / "in.png")
    edited = tmp_path / "edited.png"
    done = run_cli(
        "generate",
        "--model",
        str(ckpt),
        "--prompt",
        "add a red hat",
        "--image",
        str(tmp_path / "in.png"),
        "--image-out",
        str(edited),
        "--edit-side",
        "32",
        "--image-guidance-scale",
        "2.0",
        "--steps",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert Image.open(edited).size == (32, 32) and "1 steps" in done.stdout


@pytest.mark.slow
def test_server_returns_a_decodable_png_of_the_requested_size(ckpt, loaded):
    with serving(ckpt, "dimoo-images") as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.images.generate(
            prompt="a red cat", size="32x16", n=2, extra_body={"steps": 2, "seed": 4}
        )
        images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in answer.data]
        assert [(i.format, i.size) for i in images] == [("PNG", (32, 16))] * 2
        want = generate_image(*loaded, "a red cat", width=32, height=16, steps=2, seed=4)
        np.testing.assert_array_equal(np.asarray(images[0].convert("RGB")), np.asarray(want))
        picture = photo(16)
        edited = client.images.edit(
            image=("in.png", encoded(picture), "image/png"),
            prompt="add a red hat",
            extra_body={"steps": 2, "seed": 3, "edit_side": 32},
        )
        got = Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json)))
        assert (got.format, got.size) == ("PNG", (32, 32))
        want = generate_image(
            *loaded, "add a red hat", image=picture, steps=2, seed=3, edit_side=32
        )
        np.testing.assert_array_equal(np.asarray(got.convert("RGB")), np.asarray(want))
        with pytest.raises(openai.BadRequestError, match="no inpainting here"):
            client.images.edit(
                image=("in.png", png(16), "image/png"),
                mask=("mask.png", png(16), "image/png"),
                prompt="a cat",
                size="16x16",
            )


def png(size) -> bytes:
    return encoded(Image.fromarray(np.zeros((size, size, 4), np.uint8)))


def encoded(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def photo(size):
    rng = np.random.default_rng(size)
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8))
