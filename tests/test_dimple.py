"""Dimple (model_type dimple): the processor against transformers' Qwen2-VL image processor, the
vision path (mlx-vlm's Qwen2.5-VL tower, Dimple's projector), the M-RoPE positions, the logits over
an image prompt and the "dim" pipeline's tokens at temperature 0, each against the torch
transcription of yu-rp/Dimple (tests/reference/dimple_torch.py); then the public surface: batches
of rows with other / several / no images, mlx_vlm.load and convert, `mlx_dllm generate --image`,
one serve request with an image_url part."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image

from fixtures.dimple import ENDOFTEXT, IM_END, IMAGE, MASK, VEND, VSTART, build
from helpers import (
    assert_close,
    assert_one_rank_keeps_logits_and_three_are_refused,
    checkpoint_fixtures,
    cut_at_eos,
    far,
    random_picture,
    served_image_answer,
    stream_tokens,
)
from mlx_dllm_models import batch_generate_diffusion, load, stream_generate_diffusion
from mlx_dllm_models.cache import Positions
from mlx_dllm_models.models import dimple
from reference import dimple_torch as ref

EOS = {IM_END, ENDOFTEXT}
SETTINGS = dict(max_tokens=12, steps=6, temperature=0.0, top_p=None, alg="maskgit_plus")


ckpt, loaded = checkpoint_fixtures("dimple", build)


def picture(seed, size=(90, 117)):
    return random_picture(seed, size)


@pytest.mark.slow
def test_processor_matches_transformers_qwen2vl_image_processor(loaded):
    """Odd sizes (a resize to multiples of 28 both ways) and the max_pixels bound (a downscale)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    _, processor = loaded
    want_proc = Qwen2VLImageProcessorPil(
        min_pixels=processor.min_pixels, max_pixels=processor.max_pixels
    )
    small = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=28 * 28 * 20)
    cases = [(picture(0), want_proc), (picture(1, (211, 95)), small)]
    try:
        from sklearn.datasets import load_sample_image

        cases.append((Image.fromarray(load_sample_image("china.jpg")), want_proc))  # 640 x 427
    except ImportError:
        pass
    for image, proc in cases:
        want = proc(images=[image], return_tensors="np")
        if proc is small:
            processor.max_pixels = 28 * 28 * 20
        got, grid = processor.preprocess(image)
        processor.max_pixels = dimple.MAX_PIXELS
        assert list(grid) == want["image_grid_thw"][0].tolist()
        np.testing.assert_allclose(got, want["pixel_values"], atol=1e-5)


def test_the_checkpoints_preprocessor_config_bounds_the_pixels(ckpt, tmp_path):
    """Qwen2.5-VL-7B-Instruct's bounds unless the checkpoint's preprocessor_config.json says
    otherwise (as DimpleImageProcessor.from_pretrained reads it)."""
    import shutil

    path = shutil.copytree(ckpt, tmp_path / "small")
    bounds = {"min_pixels": 3136, "max_pixels": 28 * 28 * 4}
    (path / "preprocessor_config.json").write_text(json.dumps(bounds))
    _, processor = load(path)
    assert (processor.min_pixels, processor.max_pixels) == (3136, 28 * 28 * 4)
    assert processor.preprocess(picture(0))[1] == (1, 2, 4)  # 28 x 56 pixels
    (path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 6272}}))
    assert load(path)[1].max_pixels == 6272


def test_vision_and_projector_match_reference(loaded, ckpt):
    model, processor = loaded
    pv, grid = processor.preprocess(picture(2))
    assert grid == (1, 6, 8)  # 3 x 4 merged patches: two 2 x 2 windows and their remainders
    want = ref.vision(ckpt, pv, grid)
    got = np.array(model.vision_tower(mx.array(pv), mx.array([list(grid)])))
    assert_close(got, want)
    assert_close(np.array(model.image_features(pv, grid)), ref.project(ckpt, want))


def image_prompt(model, processor, seed=3, before=(257, 72, 105), after=(33, 40, 258)):
    """(our ids, the reference's ids, pixel values, grid) of text, one image, text."""
    pv, grid = processor.preprocess(picture(seed))
    slots = model.image_slots(pv, grid)
    ours = [*before, VSTART, *slots, VEND, *after]
    theirs = [*before, VSTART, *[IMAGE] * len(slots), VEND, *after]
    return ours, theirs, pv, grid


def test_positions_are_get_rope_index(loaded, ckpt):
    """Two images and left padding: the positions derived from the ids are the reference's."""
    model, processor = loaded
    a, ra, pv_a, g_a = image_prompt(model, processor, 4)
    b, rb, pv_b, g_b = image_prompt(model, processor, 5, before=(), after=(99,))
    ours, theirs = a + b + [MASK] * 3, ra + rb + [MASK] * 3
    pad = 4
    ids = mx.array([[ENDOFTEXT] * pad + ours, [300] * pad + ours])
    cache = Positions.for_left_padding([pad, 0], 1)
    got = np.array(model.positions(ids, cache))
    keep = torch.ones(2, pad + len(theirs), dtype=torch.long)
    keep[0, :pad] = 0
    grids = np.array([g_a, g_b, g_a, g_b])
    want = ref.rope_index(ckpt, torch.tensor([[ENDOFTEXT] * pad + theirs] * 2), grids, keep)
    np.testing.assert_array_equal(got[:, 0, pad:], want[:, 0, pad:].numpy())
    np.testing.assert_array_equal(got[:, 1], want[:, 1].numpy())
    assert got[1, 0, pad:].max() < pad + len(ours) - 10  # images advance less than their length


def test_logits_over_an_image_prompt_match_reference(loaded, ckpt):
    model, processor = loaded
    ours, theirs, pv, grid = image_prompt(model, processor)
    got = np.array(model(mx.array([ours + [MASK] * 6])))
    want = ref.logits(ckpt, [theirs + [MASK] * 6], pv, grid).numpy()
    assert_close(got, want)
    other, *_ = image_prompt(model, processor, seed=6)
    assert far(np.array(model(mx.array([other + [MASK] * 6]))), want)  # the image is read
    # Plain 1-D RoPE over the columns (Dream's) would be a wrong reading.
    plain = ref.logits(ckpt, [[300] * len(theirs) + [MASK] * 6])
    assert far(plain.numpy(), want)


# (max_tokens, steps, alg, alg_p_threshold)
CASES = [
    (12, 12, "maskgit_plus", 0.0),
    (12, 5, "maskgit_plus", 0.0),
    (16, 16, "maskgit_plus", 0.6),
    (12, 4, "entropy", 0.0),
    (10, 10, "autoregressive", 0.0),
    (12, 12, "autoregressive", 0.6),
]


@pytest.mark.parametrize("cache", ["none", "prefill"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_the_dim_pipeline(loaded, ckpt, case, cache):
    """cache="prefill" is the reference's use_cache=True (the README's): the prompt's K/V from the
    first step, an approximation whose tokens differ from full recompute's (checked below)."""
    model, processor = loaded
    gen, steps, alg, threshold = case
    ours, theirs, pv, grid = image_prompt(model, processor, seed=7)
    settings = dict(
        max_tokens=gen, steps=steps, temperature=0.0, top_p=None, alg=alg,
        alg_p_threshold=threshold,
        cache=cache,
    )  # fmt: skip
    got = stream_tokens(model, processor, ours, **settings)
    cached = cache == "prefill"
    want = ref.generate(ckpt, theirs, pv, grid, MASK, gen, steps, alg, threshold, use_cache=cached)
    assert got == cut_at_eos(want, EOS)
    assert len(got) > 2
    if cached:
        full = ref.generate(ckpt, theirs, pv, grid, MASK, gen, steps, alg, threshold)
        assert full != want


@pytest.mark.parametrize("cache", ["none", "prefill"])
@pytest.mark.parametrize("case", [(12, 12), (16, 6)])
def test_greedy_tokens_match_the_dream_pipeline(loaded, ckpt, case, cache):
    """decoding_pipeline="dream" (lmms-eval's dimple.sh) is sampler "dream": Dream's schedule, the
    confidence of the top-p filtered distribution (use_original_confidence=False), top-p acting
    at temperature 0 (0.999 here: dimple.sh's 0.01 leaves one token a position, every confidence 1,
    and the order of ties decides)."""
    model, processor = loaded
    gen, steps = case
    ours, theirs, pv, grid = image_prompt(model, processor, seed=7)
    kw = dict(max_tokens=gen, steps=steps, temperature=0.0, top_p=0.999, alg="maskgit_plus")
    got = stream_tokens(model, processor, ours, sampler="dream", cache=cache, **kw)
    want = ref.generate(
        ckpt, theirs, pv, grid, MASK, gen, steps, "maskgit_plus", use_cache=cache == "prefill",
        pipeline="dream", top_p=0.999,
    )  # fmt: skip
    assert got == cut_at_eos(want, EOS) and len(got) > 2


def test_top_p_at_temperature_0_is_refused_only_where_it_changes_nothing(loaded):
    from mlx_dllm_models.settings import SettingsError

    model, processor = loaded
    dimple_sh = dict(max_tokens=8, steps=8, temperature=0.0, top_p=0.01, alg="maskgit_plus")
    assert stream_tokens(model, processor, [257, 72], sampler="dream", **dimple_sh)
    with pytest.raises(SettingsError, match="top_p has no effect at temperature 0"):
        stream_tokens(model, processor, [257, 72], **dimple_sh)  # "dimple": the model's own


def test_confident_decoding_takes_fewer_steps(loaded):
    model, processor = loaded
    ours, *_ = image_prompt(model, processor, seed=7)
    kw = dict(max_tokens=16, steps=16, temperature=0.0, top_p=None, alg="maskgit_plus")
    runs = [
        list(stream_generate_diffusion(model, processor, ours, alg_p_threshold=t, **kw))
        for t in (0.0, 0.6)
    ]
    assert runs[1][-1].nfe < runs[0][-1].nfe


def test_defaults_are_the_readme_recipe(loaded):
    spec = loaded[0].diffusion_spec
    d = spec.defaults
    assert (d["sampler"], d["alg"], d["alg_p_threshold"]) == ("dimple", "origin", 0.95)
    assert (d["temperature"], d["top_p"], d["max_tokens"]) == (0.2, 0.95, 64)
    assert spec.mask_token_id == MASK and spec.logit_shift == 1 and spec.confidence == "raw"
    assert spec.sampler_defaults["dimple"] == {"block_length": None}
    assert d["cache"] == "prefill"  # the README's use_cache=True


def test_real_config_builds():
    """rp-yu/Dimple-7B's config (tests/data, reconstructed), at full size, never evaluated."""
    path = Path(__file__).parent / "data/rp-yu__Dimple-7B/config.json"
    args = dimple.ModelArgs.from_dict(json.loads(path.read_text()))
    assert args.mask_token_id == 151666 and args.image_token_id == 151655
    assert args.hidden_size == args.tower["out_hidden_size"] == 3584
    assert args.mrope_section == [16, 24, 24] and args.tower["depth"] == 32


def test_bad_input_is_a_clear_error(loaded):
    with pytest.raises(ValueError, match="full_attn_mask false"):
        dimple.ModelArgs.from_dict({"full_attn_mask": False})
    with pytest.raises(ValueError, match="mrope_section"):
        dimple.ModelArgs.from_dict({"mrope_section": [8, 8, 8]})
    model, processor = loaded
    from mlx_dllm_models.settings import SettingsError

    with pytest.raises(
        SettingsError, match="alg 'topk_margin' does not decode with sampler 'dimple'"
    ):
        stream_tokens(model, processor, [257, 72], alg="topk_margin", max_tokens=4)
    with pytest.raises(
        SettingsError, match="alg 'origin-ratio' does not decode with sampler 'dream'"
    ):
        stream_tokens(model, processor, [257, 72], alg="origin-ratio", sampler="dream")
    with pytest.raises(ValueError, match="1 <|vision_start|>"):
        processor(text=["a" + processor.image_token], images=[picture(0), picture(1)])


# ----------------------------------------------------------------------------- public surface

FAST = dict(max_tokens=8, steps=4, temperature=0.0, top_p=None, alg="maskgit_plus")


def test_batch_rows_with_other_several_or_no_images_equal_single_runs(loaded):
    model, processor = loaded
    t = processor.image_token
    prompts = [f"{t}What is it?", f"{t} and {t}: which?", "No picture here", f"{t}?"]
    images = [picture(8), [picture(9), picture(10, (60, 60))], None, picture(11, (40, 130))]
    batch = batch_generate_diffusion(model, processor, prompts, images=images, **FAST)
    for prompt, image, tokens in zip(prompts, images, batch.tokens):
        assert tokens == stream_tokens(model, processor, prompt, image=image, **FAST)
    assert batch.tokens[0] != stream_tokens(model, processor, prompts[0], image=picture(12), **FAST)


def test_mlx_lm_and_mlx_vlm_load_and_mlx_vlm_convert_build_this_model(loaded, ckpt, tmp_path):
    import mlx_lm
    import mlx_vlm
    from mlx_vlm.convert import convert

    model, processor = loaded
    image = picture(13)
    prompt = processor.image_token + "hi"
    want = stream_tokens(model, processor, prompt, image=image, **FAST)
    # mlx_lm.load's bare tokenizer takes images too (the processor is built on it).
    lm_model, tokenizer = mlx_lm.load(str(ckpt))
    assert stream_tokens(lm_model, tokenizer, prompt, image=image, **FAST) == want
    vlm_model, _ = mlx_vlm.load(str(ckpt))
    assert isinstance(vlm_model, dimple.Model)
    pv, grid = processor.preprocess(image)
    logits = [
        np.array(m(mx.array([[257, VSTART] + m.image_slots(pv, grid) + [VEND, MASK]])))
        for m in (vlm_model, model)
    ]
    assert np.array_equal(*logits)
    # mlx-lm's convert keeps vision_config (the tower sits at model.vision_tower, where its save
    # looks) and the tower's weights, already in mlx's layout.
    mlx_lm.convert(str(ckpt), mlx_path=str(tmp_path / "lm"))
    converted, converted_processor = load(tmp_path / "lm")
    assert stream_tokens(converted, converted_processor, prompt, image=image, **FAST) == want
    # mlx_vlm.convert asks AutoProcessor for the processor, which follows config.json's auto_map
    # to the remote code (the published repo ships it, the fixture does not): a copy without it.
    import shutil

    src = shutil.copytree(ckpt, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["auto_map"]
    (src / "config.json").write_text(json.dumps(cfg))
    convert(str(src), mlx_path=str(tmp_path / "vlm"))
    converted, converted_processor = load(tmp_path / "vlm")
    assert stream_tokens(converted, converted_processor, prompt, image=image, **FAST) == want


def test_cli_generate_with_an_image(loaded, ckpt, tmp_path, capsys):
    from mlx_dllm_models import generate_diffusion
    from mlx_dllm_models.cli import main as cli_main
    from mlx_dllm_models.vision import text_tokenizer

    model, processor = loaded
    path = tmp_path / "picture.png"
    picture(14).save(path)
    args = ["generate", "--model", str(ckpt), "--prompt", "describe", "--image", str(path)]
    flags = ["--max-tokens", "8", "--steps", "4", "--temp", "0", "--no-live"]
    assert cli_main(args + flags + ["--alg", "maskgit_plus"]) == 0
    out = capsys.readouterr().out
    messages = [{"role": "user", "content": processor.image_token + "describe"}]
    prompt = text_tokenizer(processor).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    want = generate_diffusion(model, processor, prompt, image=str(path), **FAST)
    assert want.strip() and want in out


def test_serve_answers_an_image_url_part(loaded, ckpt):

    from mlx_dllm_models.vision import text_tokenizer

    model, processor = loaded
    text = served_image_answer(ckpt, "dimple", picture(15), "x", **FAST)
    messages = [{"role": "user", "content": processor.image_token + "x"}]
    prompt = text_tokenizer(processor).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    runs = stream_generate_diffusion(model, processor, prompt, image=[picture(15)], **FAST)
    want = "".join(r.text for r in runs)
    assert want and text == want


def test_shard_over_one_rank_keeps_image_logits_and_three_ranks_are_refused(ckpt):
    model, processor = load(ckpt)  # its own copy: shard changes it
    ours, *_ = image_prompt(model, processor, seed=16)
    ids = mx.array([ours + [MASK] * 4])
    assert_one_rank_keeps_logits_and_three_are_refused(model, ids)


@pytest.mark.parametrize("alg", ["origin", "origin-ratio"])
def test_the_readme_recipe_decodes_batches_as_single_runs(loaded, alg):
    """The defaults (origin's random order, confident decoding at 0.95, temperature 0.2; and
    origin-ratio's random draws): each row of a batch, with its own seed's draws, equals its run
    alone."""
    model, processor = loaded
    t = processor.image_token
    prompts, images = [f"{t}What is it?", "No picture"], [picture(17), None]
    kw = dict(max_tokens=8, seed=3, alg=alg)
    batch = batch_generate_diffusion(model, processor, prompts, images=images, **kw)
    for prompt, image, tokens in zip(prompts, images, batch.tokens):
        assert len(tokens) > 0
        assert tokens == stream_tokens(model, processor, prompt, image=image, **kw)


def test_a_forward_from_a_later_column_reads_the_image_offsets_of_the_first(loaded):
    """What the prefill backend runs: a forward over the whole sequence into the window cache,
    then one from the prompt's last column against its K/V: with the same tokens, the logits are
    the full forward's (the later forward's positions continue past the images)."""
    from mlx_dllm_models.cache import ApproximateKVCache

    model, processor = loaded
    ours, *_ = image_prompt(model, processor, seed=18)
    ids = ours + [MASK] * 6
    cache = ApproximateKVCache(len(model.layers), len(ids))
    full = np.array(model(mx.array([ids]), cache=cache.at(0)))
    cache.commit(len(ids))
    w0 = len(ours) - 1
    window = np.array(model(mx.array([ids[w0:]]), cache=cache.at(w0)))
    assert_close(window, full[:, w0:])
    # Positions from the window's own columns (no image offsets) would be a wrong reading.
    cache.row_state.clear()
    with pytest.raises(ValueError, match="needs the same run's forward from column 0"):
        model(mx.array([ids[w0:]]), cache=cache.at(w0))
