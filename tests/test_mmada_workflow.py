"""MMaDA as a checkpoint: its text forward is LLaDA 8B's (the torch reference's logits over the
whole resized vocabulary), plain `python -m mlx_lm convert` keeps its `vq_model/` folder, and the
converted folder generates the same image as the source."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures.mmada import NEW_VOCAB, build_mmada
from helpers import convert_and_generate
from mlx_dllm_models import load
from mlx_dllm_models.images import generate_image
from reference.llada_torch import reference_logits


@pytest.fixture(scope="module")
def ckpt(fixture_dir):
    return build_once(fixture_dir / "mmada", build_mmada)


def test_text_logits_are_llada_8bs_over_the_resized_vocabulary(ckpt):
    model, tok = load(str(ckpt))
    assert type(model).__module__ == "mlx_dllm_models.models.mmada"
    ids = np.array([tok.encode("hello <|mdm_mask|><|mdm_mask|> world")], dtype=np.int64)
    got = np.array(model(mx.array(ids)))
    assert got.shape[-1] == NEW_VOCAB
    np.testing.assert_allclose(got, reference_logits(ckpt, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_mlx_lm_convert_keeps_the_vq_model_and_the_image(ckpt, tmp_path):
    """Plain `python -m mlx_lm convert`, then plain `mlx_lm.load` and text generation in the same
    fresh interpreter; the converted folder draws the source's image."""
    out = tmp_path / "converted"
    run = convert_and_generate(ckpt, out, ["hello"], max_tokens=8, seed=0)
    assert run["module"] == "mlx_dllm_models.models.mmada" and len(run["tokens"][0]) > 0
    config = run["config"]
    assert config["model_type"] == "mmada" and "auto_map" not in config
    assert config["new_vocab_size"] == NEW_VOCAB and config["codebook_size"] == 64
    assert (out / "vq_model" / "config.json").is_file()
    source = generate_image(*load(str(ckpt)), "a red cat", steps=4, seed=2)
    converted = generate_image(*load(str(out)), "a red cat", steps=4, seed=2)
    np.testing.assert_array_equal(np.asarray(converted), np.asarray(source))


def test_image_defaults_are_the_references(ckpt):
    """inference_t2i.py as the README runs it (guidance_scale=3.5 generation_timesteps=15, the
    demo yaml's max_seq_length 512, no generation_temperature: 1.0) and prompting_utils.py's
    reserved_token_mapping."""
    model, _ = load(str(ckpt))
    spec = model.image_spec
    assert (spec.guidance_scale, spec.steps, spec.temperature, spec.max_text_len) == (
        3.5,
        15,
        1.0,
        512,
    )
    assert (spec.codebook_size, spec.num_vq_tokens, spec.num_new_special_tokens) == (64, 16, 0)
    want = {"<|soi|>": 126084, "<|eoi|>": 126085, "<|t2i|>": 126088, "[iPAD]": 126093}
    assert {k: spec.special_tokens[k] for k in want} == want


def test_a_tokenizer_without_the_names_takes_the_reserved_ids(ckpt):
    """LLaDA's tokenizer names 126084.. <|reserved_token_N|>: the reference's ids are used."""
    from transformers import AutoTokenizer

    from mlx_dllm_models.images import special_ids

    model, _ = load(str(ckpt))
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert special_ids(tok, model.image_spec)["<|soi|>"] == 284  # named: the tokenizer's id

    class Unnamed:
        unk_token, unk_token_id = None, None

        def convert_tokens_to_ids(self, name):
            return None

    ids = special_ids(Unnamed(), model.image_spec)
    assert ids == {"<|t2i|>": 126088, "<|soi|>": 126084, "<|eoi|>": 126085, "[iPAD]": 126093}


def test_image_tokens_past_the_vocabulary_are_refused(ckpt):
    """A tokenizer longer than the model's tables leave room for (offset + codebook > rows)."""
    from dataclasses import replace

    from mlx_dllm_models.errors import SettingsError
    from mlx_dllm_models.images import codebook_offset

    model, tok = load(str(ckpt))
    assert model.image_spec.vocab_rows == NEW_VOCAB
    assert codebook_offset(tok, model.image_spec) == 300
    small = replace(model.image_spec, vocab_rows=300 + 63)
    with pytest.raises(SettingsError, match="exceed the model's 363 vocabulary rows"):
        codebook_offset(tok, small)


def test_text_defaults_are_generate_pys_main(ckpt):
    """MMaDA's generate.py main(): generate(steps=128, gen_length=128, block_length=128,
    temperature=1, remasking='low_confidence'); the family's page quotes them."""
    from pathlib import Path

    from mlx_dllm_models.settings import resolve_settings

    model, _ = load(str(ckpt))
    got = resolve_settings(model.diffusion_spec, {}, {})
    want = dict(max_tokens=128, block_length=128, steps=128, temperature=1.0, sampler="quota")
    assert {k: getattr(got, k) for k in want} == want
    page = Path(__file__).resolve().parents[1] / "docs" / "families" / "mmada.md"
    assert "128 tokens in one block of 128, 128 steps, temperature 1" in page.read_text()
