"""`mlx_vlm.load` of a vision checkpoint whose model encodes its own images (LLaDA-V, Dimple,
Nemotron-Labs-Diffusion-VLM, LaViDa: no processor config in the checkpoint) returns that model's
processor, not the bare tokenizer mlx-vlm finds; and the public API given such a bare tokenizer
encodes the images with the model's processor too (it raised a TypeError before)."""

import mlx_vlm
import pytest

from fixtures import build_once
from fixtures import dimple as dimple_fx
from fixtures import nemotron_vlm as nvlm_fx
from fixtures.llada_v import build_llada_v
from helpers import random_picture
from mlx_dllm_models import generate_diffusion, load
from mlx_dllm_models.vision import is_processor, text_tokenizer

BUILDERS = {"llada_v": build_llada_v, "dimple": dimple_fx.build, "nemotron_vlm": nvlm_fx.build}
SETTINGS = dict(max_tokens=8, block_length=8, steps=4)


def picture(seed, size=(40, 70)):
    return random_picture(seed, size)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_mlx_vlm_load_returns_the_models_processor(fixture_dir, name):
    path = build_once(fixture_dir / name, BUILDERS[name])
    model, processor = load(path)
    vlm_model, vlm_processor = mlx_vlm.load(str(path))
    assert type(vlm_processor) is type(processor) and is_processor(vlm_processor)
    prompt = f"{processor.image_token}What is it?"
    want = generate_diffusion(model, processor, prompt, image=picture(0), **SETTINGS)
    got = generate_diffusion(vlm_model, vlm_processor, prompt, image=picture(0), **SETTINGS)
    assert got == want and len(want) > 0
    # The bare Hugging Face tokenizer works as well: the model's processor is put around it.
    bare = text_tokenizer(processor)._tokenizer
    got = generate_diffusion(model, bare, prompt, image=picture(0), **SETTINGS)
    assert got == want
