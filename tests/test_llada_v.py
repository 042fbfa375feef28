"""LLaDA-V (model_type llava_llada): the vision path (mlx-vlm's SigLIP tower, projector and
packing), the logits over a prompt holding an image, and greedy decoding with LLaDA's engine, each
against the torch transcription of ML-GSAI/LLaDA-V (tests/reference/llada_v_torch.py)."""

import json
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from fixtures.llada import LLADA_TOKENS
from fixtures.llada_v import SUPPRESSED, TILE, build_llada_v
from helpers import (
    assert_close,
    assert_one_rank_keeps_logits_and_three_are_refused,
    checkpoint_fixtures,
    far,
)
from mlx_dllm_models.models import llava_llada
from reference import llada_v_torch as ref

MASK = LLADA_TOKENS["<|mdm_mask|>"]
EOT = LLADA_TOKENS["<|eot_id|>"]


ckpt, loaded = checkpoint_fixtures("llada_v", build_llada_v)


@pytest.fixture(scope="module")
def model(loaded):
    return loaded[0]


def pixels(seed):
    return np.random.default_rng(seed).uniform(-1, 1, (1, 3, TILE, TILE)).astype(np.float32)


def test_tower_projector_and_image_features_match_reference(model, ckpt):
    pv = pixels(0)
    tower_ref, proj_ref, image_ref = ref.image_features(ckpt, pv)
    x = mx.array(pv).transpose(0, 2, 3, 1)
    *_, hidden = model.vision.vision_tower(x, output_hidden_states=True)
    tower = np.array(hidden[-1])
    assert_close(tower, tower_ref)
    # post_layernorm (which the reference does not apply) would be a wrong reading.
    assert far(
        np.array(model.vision.vision_tower.vision_model.post_layernorm(hidden[-1])), tower_ref
    )
    assert_close(np.array(model.vision.multi_modal_projector(hidden[-1])), proj_ref)
    feats = np.array(model.image_features(pv))
    assert feats.shape == ((TILE // 14) ** 2 + 1, 64)  # the patches, then image_newline
    assert_close(feats, image_ref)


def prompt_with_image(model, seed=0, before=(300, 72, 105), after=(33, 313)):
    slots = model.image_slots(pixels(seed))
    return list(before), slots, list(after)


def test_logits_over_an_image_prompt_match_reference(model, ckpt):
    before, slots, after = prompt_with_image(model)
    ids = before + slots + after + [MASK] * 6
    got = np.array(model(mx.array([ids])))
    _, _, image = ref.image_features(ckpt, pixels(0))
    embeds = ref.embed_prompt(ckpt, before, image, after + [MASK] * 6)
    want = ref.logits(ckpt, embeds).numpy()
    assert_close(got, want)
    # The image matters: another image's features give other logits.
    other = model.image_slots(pixels(1))
    assert far(np.array(model(mx.array([before + other + after + [MASK] * 6]))), want)


def test_image_ids_index_the_stored_features(model):
    a = model.image_slots(pixels(2))
    b = model.image_slots(pixels(3))
    assert a[0] >= model.args.vocab_size and b[0] == a[-1] + 1
    emb = np.array(model.embed(mx.array([a + b])))[0]
    assert_close(emb[: len(a)], np.array(model.image_features(pixels(2))))
    assert_close(emb[len(a) :], np.array(model.image_features(pixels(3))))


def test_defaults_are_the_reference_recipe(model):
    spec = model.diffusion_spec
    assert spec.mask_token_id == MASK
    assert set(spec.logit_suppressed_token_ids) == set(SUPPRESSED)
    d = spec.defaults
    assert (d["max_tokens"], d["block_length"], d["steps"], d["temperature"]) == (
        128,
        128,
        128,
        0.0,
    )
    assert spec.eos_token_names == ("<|eot_id|>",)


def test_real_config_builds(tmp_path):
    """GSAI-ML/LLaDA-V's config (tests/data, reconstructed) at full size, never evaluated."""
    from pathlib import Path

    cfg = json.loads((Path(__file__).parent / "data/GSAI-ML__LLaDA-V/config.json").read_text())
    args = llava_llada.ModelArgs.from_dict(cfg)
    assert args.mask_token_id == 126336 and args.tower["num_hidden_layers"] == 27
    assert args.suppressed_token_ids == [126081, 126080, 126346, 126347]
    assert args.llada_args.d_model == 4096 and args.image_aspect_ratio == "anyres_max_4"


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="mm_projector_type 'linear' is not supported"):
        llava_llada.ModelArgs.from_dict({"mm_projector_type": "linear"})
    with pytest.raises(ValueError, match="mm_hidden_size 99 differs"):
        llava_llada.ModelArgs.from_dict({"mm_hidden_size": 99})
    with pytest.raises(ValueError, match="image_aspect_ratio 'pad' is not supported"):
        llava_llada.ModelArgs.from_dict({"image_aspect_ratio": "pad"})


def tokens(model, tok, ids, **settings):
    from helpers import stream_tokens

    return stream_tokens(model, tok, ids, **settings)


# (max_tokens, block_length, the reference's total steps)
CASES = [(32, 32, 32), (32, 8, 16), (24, 8, 24), (16, 16, 4)]


# The fixture with <|eot_id|> winning where token 32 would: its answers stop early.
eot_ckpt, eot_loaded = checkpoint_fixtures(
    "llada_v_eot", partial(build_llada_v, eot_like=32), "eot_loaded", "eot_ckpt"
)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_generate_with_embeds(loaded, ckpt, case):
    check_greedy(loaded, ckpt, case)


@pytest.mark.parametrize("case", CASES[1:3])
def test_answers_stop_at_eot_as_the_reference(eot_loaded, eot_ckpt, case):
    want = check_greedy(eot_loaded, eot_ckpt, case)
    assert len(want) < case[0]


def check_greedy(loaded, ckpt, case):
    from helpers import cut_at_eos

    model, tok = loaded
    gen, block, steps = case
    before, slots, after = prompt_with_image(model, seed=4)
    got = tokens(
        model,
        tok,
        before + slots + after,
        max_tokens=gen,
        block_length=block,
        steps=steps // (gen // block),
    )
    _, _, image = ref.image_features(ckpt, pixels(4))
    want = ref.generate_with_embeds(
        ckpt,
        ref.embed_prompt(ckpt, before, image, after),
        steps=steps,
        gen_length=gen,
        block_length=block,
        mask_id=MASK,
        suppressed=SUPPRESSED,
        stop_ids={EOT},
    )
    assert cut_at_eos(got, {EOT}) == want
    assert len(want) > 0
    return want


def test_suppressed_ids_are_never_proposed(loaded, ckpt):
    """Without the reference's suppression the fixture's answer would be another (its head favours
    the suppressed ids), so the greedy parity above checks it."""
    gen, block, steps = CASES[0]
    before, _, after = prompt_with_image(loaded[0], seed=4)
    _, _, image = ref.image_features(ckpt, pixels(4))
    embeds = ref.embed_prompt(ckpt, before, image, after)
    kw = dict(steps=steps, gen_length=gen, block_length=block, mask_id=MASK, stop_ids={EOT})
    plain = ref.generate_with_embeds(ckpt, embeds, suppressed=[], **kw)
    assert any(t in SUPPRESSED for t in plain)
    assert plain != ref.generate_with_embeds(ckpt, embeds, suppressed=SUPPRESSED, **kw)


def test_ids_past_the_vocabulary_without_an_image_are_refused(model):
    with pytest.raises(llava_llada.ImageSlotError, match="stand for no stored image"):
        model(mx.array([[300, model.args.vocab_size + 10**6]]))


def test_greedy_tokens_over_an_anyres_image_match_generate_with_embeds(loaded, ckpt):
    """An oblong image in several tiles (the processor's anyres tiling): the features the
    reference packs, then its greedy decoding."""
    from PIL import Image

    from helpers import cut_at_eos

    model, processor = loaded
    rng = np.random.default_rng(12)
    image = Image.fromarray((rng.random((100, 60, 3)) * 255).astype(np.uint8))
    tiles, hw = processor.tiles(image)
    assert tiles.shape[0] > 2
    before, after = [300, 72, 105], [33, 313]
    ids = before + model.image_slots(tiles, hw) + after
    got = tokens(model, processor, ids, max_tokens=32, block_length=8, steps=4)
    features = ref.anyres_image_features(ckpt, tiles, image.size)
    want = ref.generate_with_embeds(
        ckpt,
        ref.embed_prompt(ckpt, before, features, after),
        steps=16,
        gen_length=32,
        block_length=8,
        mask_id=MASK,
        suppressed=SUPPRESSED,
        stop_ids={EOT},
    )
    assert want and cut_at_eos(got, {EOT}) == want


def test_forgotten_image_features_are_a_clear_error(ckpt, monkeypatch):
    """Past MAX_STORED_FEATURES rows the oldest image's features go; its ids then say so."""
    from mlx_dllm_models import load

    model, _ = load(ckpt)  # its own store
    n = model.image_features(pixels(0)).shape[0]
    monkeypatch.setattr(llava_llada, "MAX_STORED_FEATURES", 2 * n)
    first = model.image_slots(pixels(0))
    second = model.image_slots(pixels(1))
    model(mx.array([[300] + first + second]))  # both kept
    third = model.image_slots(pixels(2))
    assert third[0] == second[-1] + 1
    assert_close(
        np.array(model.embed(mx.array([third])))[0], np.array(model.image_features(pixels(2)))
    )
    with pytest.raises(llava_llada.ImageSlotError, match="features were dropped"):
        model(mx.array([[300] + first]))


def test_shard_over_one_rank_keeps_the_logits_and_three_ranks_are_refused(ckpt):
    from mlx_dllm_models import load

    model, _ = load(ckpt)
    ids = mx.array([[300] + model.image_slots(pixels(5)) + [72, MASK, MASK]])
    assert_one_rank_keeps_logits_and_three_are_refused(model, ids)
