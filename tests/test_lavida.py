"""LaViDa-LLaDA (model_type llava_llada, told apart from LLaDA-V by its LLaDAConfig fields): the
vision path (LLaDA-V's tower and projector, then LaViDa's 2D pool before the anyres packing), the
prefix-DLM logits (the prompt's K/V computed alone, the answer against them) and greedy decoding
with its prefix cache (and, cache "none", without: prefix_lm=False), each against the torch
transcription of jacklishufan/LaViDa
(tests/reference/lavida_torch.py); then images through the public API, mlx-vlm, the CLI and the
server."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures.lavida import build_lavida
from fixtures.llada import LLADA_TOKENS
from helpers import (
    assert_close,
    checkpoint_fixtures,
    cut_at_eos,
    far,
    random_picture,
    stream_tokens,
    vlm_convert_cli_and_serve,
)
from mlx_dllm_models import batch_generate_diffusion
from mlx_dllm_models.errors import SettingsError
from mlx_dllm_models.masks import prompt_block_mask
from mlx_dllm_models.models import lavida, llava_llada
from mlx_dllm_models.spec import PREFIX_DLM
from reference import lavida_torch as ref

MASK = LLADA_TOKENS["<|mdm_mask|>"]
STOP = {LLADA_TOKENS["<|eot_id|>"], LLADA_TOKENS["<|endoftext|>"]}
SETTINGS = dict(max_tokens=16, block_length=8, steps=4)


ckpt, loaded = checkpoint_fixtures("lavida", build_lavida)


def picture(seed, size=(90, 150)):
    return random_picture(seed, size)


@pytest.mark.parametrize("shape", [(90, 150), (160, 60)])
def test_tower_projector_pool_and_packing_match_the_reference(loaded, ckpt, shape):
    model, processor = loaded
    image = picture(0, shape)
    pixels, hw = processor.tiles(image)
    tower_ref, proj_ref, image_ref = ref.image_features(ckpt, pixels, image.size)
    *_, hidden = model.vision.vision_tower(
        mx.array(pixels).transpose(0, 2, 3, 1), output_hidden_states=True
    )
    assert_close(np.array(hidden[-1]), tower_ref)
    projected = model.vision.multi_modal_projector(hidden[-1])
    assert_close(np.array(projected), proj_ref)
    got = np.array(model.image_features(pixels, hw))
    assert got.shape == image_ref.shape and got.shape[0] > 9  # base 3 x 3, then the tiles' rows
    assert_close(got, image_ref)
    # The pool is bilinear (5 x 5 -> 3 x 3), not a 2 x 2 average, and runs before the packing.
    average = lavida.pool(projected, 5, "average")
    assert average.shape[1] == 4
    assert far(np.array(lavida.pool(projected, 5, "bilinear"))[0, :4], np.array(average)[0])


def prompt(model, processor, seed):
    slots = model.image_slots(*processor.tiles(picture(seed)))
    return [300, 72], slots, [105, 33, 313]


def test_prefix_dlm_logits_match_the_reference_prefix_cache(loaded, ckpt):
    model, processor = loaded
    before, slots, after = prompt(model, processor, 1)
    answer = [MASK] * 4 + [40, 41] + [MASK] * 6
    ids = before + slots + after
    P, L = len(ids), len(ids) + len(answer)
    got = model(mx.array([ids + answer]), mask=prompt_block_mask(L, P, L), head_span=(P, L))
    image = ref.image_features(ckpt, processor.tiles(picture(1))[0], picture(1).size)[2]
    cache = ref.prefix_cache(ckpt, ref.embed_prompt(ckpt, before, image, after))
    want = ref.answer_logits(ckpt, cache, [answer]).numpy()
    assert_close(np.array(got), want)
    # The prompt not seeing the answer is what makes its K/V exact: bidirectional logits differ.
    assert far(np.array(model(mx.array([ids + answer]), head_span=(P, L))), want)


# (max_tokens, block_length, the reference's step_per_block, step_ratio, schedule, its shift);
# a schedule decodes with sampler "lavida".
CASES = [
    (16, 16, None, None, None, None),
    (16, 8, 4, None, None, None),
    (24, 8, 8, None, None, None),
    (16, 16, None, 0.5, "shift", 3.0),  # predict.py's timed call
    (24, 8, None, 0.5, "shift", 0.33),  # run_coco.sh
    (16, 16, None, 0.75, "linear", None),
]
# cache "prefix" is the reference's prefix_lm=True, "none" its prefix_lm=False (KV cache off).
RUNS = [(c, "prefix") for c in CASES] + [(c, "none") for c in (CASES[0], CASES[1], CASES[3])]


@pytest.mark.parametrize("case, cache", RUNS)
def test_greedy_tokens_match_the_reference_generate(loaded, ckpt, case, cache):
    from mlx_dllm_models import stream_generate_diffusion

    model, processor = loaded
    gen, block, per_block, ratio, schedule, shift = case
    before, slots, after = prompt(model, processor, 2)
    image = ref.image_features(ckpt, processor.tiles(picture(2))[0], picture(2).size)[2]
    want, nfe = ref.generate(
        ckpt,
        ref.embed_prompt(ckpt, before, image, after),
        max_new_tokens=gen,
        block_length=block,
        mask_id=MASK,
        step_per_block=per_block,
        step_ratio=ratio,
        schedule=schedule,
        shift=shift or 3,
        prefix_lm=cache == "prefix",
    )
    steps = per_block or gen // (gen // block)
    extra = {}
    if schedule is not None:
        steps = int(steps * ratio)
        extra = dict(sampler="lavida", schedule=schedule)
        if shift is not None:
            extra["schedule_shift"] = shift
    runs = list(
        stream_generate_diffusion(
            model,
            processor,
            before + slots + after,
            max_tokens=gen,
            block_length=block,
            steps=steps,
            cache=cache,
            temperature=0.0,
            **extra,
        )
    )
    got = [t for r in runs for t in r.tokens]
    want = cut_at_eos(want[0].tolist(), STOP)
    assert got == want and len(want) > 2
    # The prefix cache's one prefill, then the reference's forwards.
    assert runs[-1].nfe == nfe + (cache == "prefix")


def test_lavida_schedule_matches_get_num_transfer_tokens_sch():
    import torch

    from mlx_dllm_models.decoding.lavida import lavida_quotas

    for schedule, shift in (("shift", 3.0), ("shift", 0.33), ("shift", 1.7), ("linear", 3.0)):
        for masks in range(1, 70, 3):
            for steps in (1, 2, 5, 8, 16, 32, 64):
                got = lavida_quotas(masks, steps, schedule, shift)
                mask_index = torch.ones(1, masks, dtype=torch.bool)
                want = ref.num_transfer_tokens_sch(mask_index, steps, schedule, shift)
                assert got == want[0].tolist(), (schedule, shift, masks, steps)


def test_batch_rows_with_other_or_no_images_equal_single_runs(loaded):
    model, processor = loaded
    prompts = ["<image>What is it?", "No picture here", "<image> and <image>?"]
    images = [picture(3), None, [picture(4, (60, 60)), picture(5)]]
    batch = batch_generate_diffusion(model, processor, prompts, images=images, **SETTINGS)
    for p, image, tokens in zip(prompts, images, batch.tokens):
        assert tokens == stream_tokens(model, processor, p, image=image, **SETTINGS)
    assert batch.tokens[0] != stream_tokens(
        model, processor, prompts[0], image=picture(6), **SETTINGS
    )


def test_config_tells_lavida_from_llada_v_and_sets_the_recipe(loaded):
    model, _ = loaded
    data = Path(__file__).parent / "data"
    real = json.loads((data / "jacklishufan__LaViDa/config.json").read_text())
    args = llava_llada.ModelArgs.from_dict(real)
    assert args.lavida and args.llada_args.d_model == 4096 and args.mask_token_id == 126336
    assert args.tower["num_hidden_layers"] == 27 and args.mm_spatial_pool_mode == "bilinear"
    llada_v = json.loads((data / "GSAI-ML__LLaDA-V/config.json").read_text())
    assert not llava_llada.ModelArgs.from_dict(llada_v).lavida
    spec = model.diffusion_spec
    assert spec.attention == PREFIX_DLM and not spec.logit_suppressed_token_ids
    d = spec.defaults
    assert (d["max_tokens"], d["block_length"], d["steps"], d["temperature"]) == (64, 64, 64, 0)
    with pytest.raises(ValueError, match="mm_spatial_pool_mode 'max' is not supported"):
        llava_llada.ModelArgs.from_dict(dict(real, mm_spatial_pool_mode="max"))
    with pytest.raises(ValueError, match="include_bias=true is not supported"):
        llava_llada.ModelArgs.from_dict(dict(real, include_bias=True))
    _, processor = loaded
    with pytest.raises(SettingsError, match="schedule only acts with sampler='lavida'"):
        stream_tokens(model, processor, "hi", max_tokens=4, schedule="shift")
    with pytest.raises(SettingsError, match="unknown schedule 'cosine'"):
        stream_tokens(model, processor, "hi", max_tokens=4, sampler="lavida", schedule="cosine")


def test_mlx_vlm_load_cli_and_serve(loaded, ckpt, tmp_path, capsys):
    """mlx_vlm.load of mlx_vlm.convert's output builds this model (the checkpoint's auto_map
    asks for no remote code); `mlx_dllm generate --image` and one chat request with an image_url
    part answer what generate_diffusion does on the chat prompt."""
    vlm_model, *_ = vlm_convert_cli_and_serve(
        loaded, ckpt, tmp_path, capsys, picture, [300] + [MASK] * 3, "lavida", SETTINGS
    )
    assert isinstance(vlm_model, llava_llada.Model) and vlm_model.args.lavida
