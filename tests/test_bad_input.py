"""Bad input gets a clear error that says what is wrong and what to do."""

import pytest

from helpers import checkpoint_fixtures
from mlx_dllm_models import generate_diffusion, load
from mlx_dllm_models.tiny import build_tiny_llada

ckpt, loaded = checkpoint_fixtures("tiny_llada", build_tiny_llada)


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint at .*convert"):
        load(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(block_length=0), "block_length must be a positive integer"),
        (dict(block_length=-4), "block_length must be a positive integer"),
        (dict(steps=0), "steps must be an integer >= 1"),
        (dict(sampler="threshold", threshold=0.0), "threshold must be in \\(0, 1\\]"),
        (dict(sampler="threshold", threshold=1.5), "threshold must be in \\(0, 1\\]"),
        (dict(sampler="nucleus"), "unknown sampler 'nucleus'.*choose one of"),
        (dict(threshold=0.9), "threshold only acts with sampler='threshold'"),
        (dict(factor=2.0), "factor only acts with sampler='factor'"),
        (dict(temperature=-1.0), "temperature must be"),
        (dict(top_p=0.9), "top_p has no effect at temperature 0"),
        (dict(cache="paged"), "cache='paged' is not available.*choose one of: auto, dual"),
        (dict(max_tokens=0), "max_tokens must be a positive integer"),
        (dict(editing_threshold=0.5), "unknown setting\\(s\\) editing_threshold"),
    ],
)
def test_bad_settings(loaded, kw, pattern):
    model, tok = loaded
    with pytest.raises(ValueError, match=pattern):
        generate_diffusion(model, tok, [10, 11], **kw)


def test_prompt_longer_than_context(loaded):
    model, tok = loaded
    limit = model.diffusion_spec.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate_diffusion(model, tok, [10] * limit, max_tokens=8)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(loaded, prompt):
    model, tok = loaded
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_diffusion(model, tok, prompt, max_tokens=8)


def test_token_id_outside_vocabulary(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_diffusion(model, tok, [10, 10_000_000], max_tokens=8)


def test_steps_follow_block_length_unless_set(loaded):
    from mlx_dllm_models.settings import resolve_settings

    spec = loaded[0].diffusion_spec
    assert resolve_settings(spec, {}).steps == spec.defaults["block_length"]
    assert resolve_settings(spec, {"block_length": 16}).steps == 16
    assert resolve_settings(spec, {"block_length": 16, "steps": 4}).steps == 4


@pytest.mark.parametrize("name", ["dimple", "lavida", "llada_v", "nemotron_vlm"])
def test_ids_past_the_vocabulary_that_name_no_stored_image_are_refused(tmp_path, name):
    """The vision families' image feature ids lie past the vocabulary, but only those of stored
    images: the first id past it and one too large for any integer type are refused before
    decoding, with what to do (they used to reach the model's embedding, or MLX's std::bad_cast)."""
    from fixtures import all_checkpoints
    from mlx_dllm_models import SettingsError

    model, tok = load(all_checkpoints()[name](tmp_path / name))
    vocab = getattr(model.args, "vocab_size", None) or model.diffusion_spec.vocab_size
    for token in (vocab, 2**70):
        with pytest.raises(SettingsError, match=f"prompt token id {token} is outside the vocab"):
            generate_diffusion(model, tok, [5, token], max_tokens=4)
