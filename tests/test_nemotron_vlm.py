"""Nemotron-Labs-Diffusion-VLM (model_type nemotron_labs_diffusion_vlm): the vision path (mlx-vlm's
Pixtral tower and Mistral-3 projector), the image block in the prompt, the logits over an image
prompt in both attention modes and greedy decoding with the text family's engine, each against
tests/reference/nemotron_vlm_torch.py (transformers' PixtralVisionModel and
Mistral3MultiModalProjector on the checkpoint's weights; NVIDIA's generate over the prompt's
embeddings)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures import nemotron as text_fx
from fixtures import nemotron_vlm as fx
from helpers import (
    assert_close,
    assert_one_rank_keeps_logits_and_three_are_refused,
    checkpoint_fixtures,
    cut_at_eos,
    far,
    random_picture,
    stream_tokens,
)
from mlx_dllm_models.models import nemotron_labs_diffusion_vlm as vlm_module
from reference import nemotron_vlm_torch as ref

L = text_fx.BLOCK_SIZE


ckpt, loaded = checkpoint_fixtures("nemotron_vlm", fx.build)


@pytest.fixture(scope="module")
def text_ref(ckpt):
    return ref.text_model(ckpt)


def picture(seed, size=(60, 90)):
    return random_picture(seed, size)


def test_tower_and_projector_match_transformers(loaded, ckpt):
    model, processor = loaded
    pixels, (w, h) = processor.preprocess(picture(0))
    assert (w, h) == (4, 3) and pixels.shape == (1, 3, 3 * 28, 4 * 28)
    tower_ref, feats_ref = ref.image_features(ckpt, pixels)
    x = mx.array(pixels).transpose(0, 2, 3, 1)
    *_, hidden = model.vision_tower(x, output_hidden_states=True, image_sizes=[x.shape[1:3]])
    assert_close(np.array(hidden[-1][0]), tower_ref)
    feats = np.array(model.image_features(pixels))
    assert feats.shape == (w * h, text_fx.HIDDEN)
    assert_close(feats, feats_ref)
    # The merge reads 2 x 2 neighbours in raster order: the image upside down is another image.
    assert far(np.array(model.image_features(pixels[:, :, ::-1])), feats_ref)


def test_image_block_is_build_image_token_str_with_feature_ids(loaded):
    model, processor = loaded
    tok = processor.tokenizer
    ids = processor(text=["ab<image>cd"], images=[picture(1)])["input_ids"][0]
    slots = [t for t in ids if model.is_image_id(t)]
    want = tok.encode("ab") + tok.encode(ref.build_image_token_str(4, 3), add_special_tokens=False)
    want += tok.encode("cd", add_special_tokens=False)
    assert len(ids) == len(want) == 4 + 1 + 3 * (4 + 1)
    pads = [i for i, t in enumerate(want) if t == fx.IMAGE_PAD]
    assert [ids[i] for i in pads] == slots and len(slots) == 12
    assert [t for i, t in enumerate(ids) if i not in pads] == [
        t for i, t in enumerate(want) if i not in pads
    ]
    assert_close(
        np.array(model.embed(mx.array([slots])))[0],
        model.image_features(processor.preprocess(picture(1))[0]),
    )


def test_image_grids_match_image_processing():
    """The merged-token grids of jevons-rs's image.rs tests (checked there against the reference
    dump: a 300 x 200 picture becomes 308 x 224 pixels)."""
    grid = vlm_module.image_grid
    assert grid(300, 200, 28) == (11, 8)
    assert grid(28, 28, 28) == (1, 1) and grid(29, 1, 28) == (2, 1)
    assert grid(2800, 1400, 28) == (50, 25)
    assert grid(4201, 3, 28) == (50, 1)
    pixels, _ = vlm_module.encode_image(picture(2, (200, 300)))
    assert pixels.shape == (1, 3, 224, 308)


def image_prompt(processor, seed=3):
    """(ids with feature ids, the same ids with pads, the image's reference features)."""
    chat = "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n"
    image = picture(seed)
    ids = processor(text=[chat], images=[image])["input_ids"][0]
    pads = [fx.IMAGE_PAD if processor.model.is_image_id(t) else t for t in ids]
    return ids, pads, image


@pytest.mark.parametrize("causal", [False, True])
def test_logits_over_an_image_prompt_match_reference(loaded, ckpt, text_ref, causal):
    model, processor = loaded
    ids, pads, image = image_prompt(processor)
    _, feats = ref.image_features(ckpt, processor.preprocess(image)[0])
    masks = [text_fx.MASK] * 6
    embeds = ref.embed_prompt(text_ref, pads + masks, feats, fx.IMAGE_PAD)
    want = ref.logits(text_ref, pads + masks, embeds, causal=causal)
    got = np.array(model(mx.array([ids + masks]), mask="causal" if causal else None))
    assert_close(got, want)
    other, _, _ = image_prompt(processor, seed=4)
    assert far(np.array(model(mx.array([other + masks]))), want)


@pytest.mark.parametrize("threshold", [None, 0.9])
def test_greedy_tokens_match_generate(loaded, ckpt, text_ref, threshold):
    model, processor = loaded
    ids, pads, image = image_prompt(processor, seed=5)
    _, feats = ref.image_features(ckpt, processor.preprocess(image)[0])
    x, _ = ref.generate(
        text_ref,
        pads,
        feats,
        fx.IMAGE_PAD,
        max_new_tokens=3 * L,
        block_length=L,
        mask_id=text_fx.MASK,
        eos_token_id=text_fx.EOS,
        threshold=threshold,
    )
    want = cut_at_eos(x[0, len(pads) :], {text_fx.EOS})
    sampler = dict(sampler="quota") if threshold is None else dict(threshold=threshold)
    got = stream_tokens(model, processor, ids, max_tokens=3 * L, **sampler)
    assert got == want and len(want) > L


def test_defaults_are_the_text_familys_recipe(loaded):
    spec = loaded[0].diffusion_spec
    assert spec.family == "nemotron" and spec.mask_token_id == text_fx.MASK
    d = spec.defaults
    assert (d["block_length"], d["sampler"], d["threshold"], d["mode"]) == (
        L,
        "threshold",
        0.9,
        "diffusion",
    )


def test_real_config_builds():
    """nvidia/Nemotron-Labs-Diffusion-VLM-8B's config (tests/data, a transcription), never built."""
    path = Path(__file__).parent / "data/nvidia__Nemotron-Labs-Diffusion-VLM-8B/config.json"
    args = vlm_module.ModelArgs.from_dict(json.loads(path.read_text()))
    assert (args.vocab_size, args.hidden_size, args.num_hidden_layers) == (131073, 4096, 34)
    v = args.vision_config
    assert (v["num_hidden_layers"], v["hidden_size"], v["patch_size"], v["image_size"]) == (
        24,
        1024,
        14,
        1540,
    )
    assert args.spatial_merge_size == 2 and args.mask_token_id == 100
    # At full size, built lazily (never evaluated): the 8B body and a 0.43B tower and projector.
    from mlx.utils import tree_flatten

    before = mx.get_active_memory()
    model = vlm_module.Model(args)
    count = lambda m: sum(v.size for _, v in tree_flatten(m.parameters()))  # noqa: E731
    assert count(model) > 8.9e9 and 4.2e8 < count(model.model) < 4.4e8
    assert mx.get_active_memory() - before < 64 << 20


def test_bad_config_is_a_clear_error(ckpt):
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    with pytest.raises(ValueError, match="has no vision_config"):
        vlm_module.ModelArgs.from_dict({k: v for k, v in cfg.items() if k != "vision_config"})
    with pytest.raises(ValueError, match="projector_hidden_act is not supported"):
        vlm_module.ModelArgs.from_dict(dict(cfg, projector_hidden_act="silu"))
    bad = dict(cfg, vision_config=dict(cfg["vision_config"], hidden_act="gelu"))
    with pytest.raises(ValueError, match="vision_config.hidden_act is not supported"):
        vlm_module.ModelArgs.from_dict(bad)


def test_ids_past_the_vocabulary_and_odd_pixels_are_refused(loaded):
    model, _ = loaded
    with pytest.raises(vlm_module.ImageSlotError, match="stand for no stored image"):
        model(mx.array([[300, model.args.vocab_size + 10**6]]))
    with pytest.raises(vlm_module.ImageSlotError, match="multiples of 28"):
        model.image_features(np.zeros((1, 3, 42, 56), np.float32))


def test_shard_over_one_rank_keeps_the_logits_and_three_ranks_are_refused(ckpt):
    """The text family's tensor parallelism (encoder.layers split); the tower and projector stay
    replicated, so every rank computes the same image features."""
    from mlx_dllm_models import load

    model, processor = load(ckpt)  # its own copy
    ids = mx.array([processor(text=["a<image>b"], images=[picture(6)])["input_ids"][0] + [258]])
    assert_one_rank_keeps_logits_and_three_are_refused(model, ids)
