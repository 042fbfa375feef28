"""LaViDa-Dream (model_type llava_dream): Dream's body under the prefix-DLM layout with LaViDa's
vision path; logits against the prompt's cached K/V and greedy tokens of its `_sample` with
prefix_lm (cache "prefix": the prefill's seed, the shifted answer logits, Dream's schedule) and
without (cache "none") against the torch transcription (tests/reference/lavida_torch.py); batch
rows with images; mlx_vlm.load."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures.dream import ENDOFTEXT, IM_END, MASK
from fixtures.lavida import build_lavida_dream
from helpers import (
    assert_close,
    checkpoint_fixtures,
    cut_at_eos,
    far,
    random_picture,
    stream_tokens,
    vlm_convert_cli_and_serve,
)
from mlx_dllm_models import batch_generate_diffusion, generate_diffusion, stream_generate_diffusion
from mlx_dllm_models.masks import prompt_block_mask
from mlx_dllm_models.models import llava_dream
from mlx_dllm_models.spec import PREFIX_DLM
from reference import lavida_torch as ref

ckpt, loaded = checkpoint_fixtures("lavida_dream", build_lavida_dream)


def picture(seed, size=(90, 150)):
    return random_picture(seed, size)


IM_START = 257  # <|im_start|> of the tiny Dream tokenizer


def prompt(model, processor, ckpt, seed):
    """(ids before, image ids, ids after, the reference's (tower, projector, image features))."""
    image = picture(seed)
    pixels, hw = processor.tiles(image)
    slots = model.image_slots(pixels, hw)
    return [IM_START, 72], slots, [105, 33], ref.image_features(ckpt, pixels, image.size)


def test_vision_and_prefix_dlm_logits_match_the_reference(loaded, ckpt):
    model, processor = loaded
    before, slots, after, (_, _, image_ref) = prompt(model, processor, ckpt, 1)
    got = np.array(model.embed(mx.array([slots])))[0]
    assert_close(got, image_ref)
    answer = [MASK] * 3 + [40, 41] + [MASK] * 5
    ids = before + slots + after
    P, L = len(ids), len(ids) + len(answer)
    logits = model(mx.array([ids + answer]), mask=prompt_block_mask(L, P, L), head_span=(P, L))
    cache = ref.prefix_cache(ckpt, ref.embed_prompt(ckpt, before, image_ref, after))
    want = ref.answer_logits(ckpt, cache, [answer]).numpy()
    assert_close(np.array(logits), want)
    assert far(np.array(model(mx.array([ids + answer]), head_span=(P, L))), want)


# cache "prefix" is the reference's prefix_lm=True, "none" its prefix_lm=False (KV cache off).
RUNS = [(alg, "prefix") for alg in ("topk_margin", "entropy", "maskgit_plus")] + [
    ("topk_margin", "none"),
    ("maskgit_plus", "none"),
]


@pytest.mark.parametrize("alg, cache", RUNS)
def test_greedy_tokens_match_the_reference_sample(loaded, ckpt, alg, cache):
    model, processor = loaded
    before, slots, after, (_, _, image_ref) = prompt(model, processor, ckpt, 2)
    gen = 16
    want = ref.dream_generate(
        ckpt,
        ref.embed_prompt(ckpt, before, image_ref, after),
        max_new_tokens=gen,
        steps=gen,
        mask_id=MASK,
        alg=alg,
        prefix_lm=cache == "prefix",
    )
    runs = stream_generate_diffusion(
        model, processor, before + slots + after, max_tokens=gen, alg=alg, cache=cache
    )
    got = [t for r in runs for t in r.tokens]
    want = cut_at_eos(want[0].tolist(), {ENDOFTEXT, IM_END})
    assert got == want and len(want) > 2


def test_the_seeded_first_token_reads_its_logprob_from_the_prefill(loaded):
    """The first column is the prefill's argmax: its log-probability is the prefill's, the top one
    (the denoising forwards' logits there are its own hidden state's, not a prediction of it)."""
    model, processor = loaded
    runs = list(
        stream_generate_diffusion(
            model,
            processor,
            "<image>What?",
            image=picture(6),
            max_tokens=8,
            logprobs=2,
        )
    )
    first = runs[0].logprobs[0]
    assert first.token == runs[0].tokens[0] and first.top[0] == (first.token, first.logprob)


def test_batch_rows_with_other_or_no_images_equal_single_runs(loaded):
    model, processor = loaded
    prompts = ["<image>What is it?", "No picture here", "<image> and <image>?"]
    images = [picture(3), None, [picture(4, (60, 60)), picture(5)]]
    settings = dict(max_tokens=12)
    batch = batch_generate_diffusion(model, processor, prompts, images=images, **settings)
    for p, image, tokens in zip(prompts, images, batch.tokens):
        assert tokens == stream_tokens(model, processor, p, image=image, **settings)


def test_recipe_and_mlx_vlm_load(loaded, ckpt):
    import mlx_vlm

    model, processor = loaded
    spec = model.diffusion_spec
    assert spec.attention == PREFIX_DLM and spec.logit_shift == 1
    d = spec.defaults
    assert (d["sampler"], d["alg"], d["temperature"], d["max_tokens"]) == (
        "dream",
        "topk_margin",
        0.0,
        256,
    )
    vlm_model, _ = mlx_vlm.load(str(ckpt))
    assert isinstance(vlm_model, llava_dream.Model)
    ids = [[IM_START] + vlm_model.image_slots(*processor.tiles(picture(7))) + [MASK] * 3]
    mine = [[IM_START] + model.image_slots(*processor.tiles(picture(7))) + [MASK] * 3]
    assert np.array_equal(np.array(vlm_model(mx.array(ids))), np.array(model(mx.array(mine))))
    data = Path(__file__).parent / "data/jacklishufan__LaViDa-Dream/config.json"
    real = json.loads(data.read_text())
    args = llava_dream.ModelArgs.from_dict(real)
    assert args.hidden_size == 3584 and args.tower["num_hidden_layers"] == 27 and args.lavida
    with pytest.raises(ValueError, match="mm_spatial_pool_mode 'max' is not supported"):
        llava_dream.ModelArgs.from_dict(dict(real, mm_spatial_pool_mode="max"))
    with pytest.raises(ValueError, match="mm_patch_merge_type 'flat' is not supported"):
        llava_dream.ModelArgs.from_dict(dict(real, mm_patch_merge_type="flat"))


def test_mlx_vlm_convert_cli_and_serve(loaded, ckpt, tmp_path, capsys):
    """mlx_vlm.convert's output loads through mlx_vlm.load as this model with the same logits;
    `mlx_dllm generate --image` and one chat request with an image_url part answer what
    generate_diffusion does on the chat prompt."""
    settings = dict(max_tokens=16)
    vlm_model, vlm_processor, chat, path, want = vlm_convert_cli_and_serve(
        loaded, ckpt, tmp_path, capsys, picture, [IM_START] + [MASK] * 3, "lavida-dream", settings
    )
    assert isinstance(vlm_model, llava_dream.Model)
    converted = generate_diffusion(vlm_model, vlm_processor, chat, image=str(path), **settings)
    assert converted == want
