"""Dream forward pass: parity with transformers' Qwen2 read bidirectionally, Dream's padding, rows."""

import json

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures.dream import ENDOFTEXT, MASK, build
from helpers import assert_close, far, load_fixture
from mlx_dllm_models.cache import Positions
from mlx_dllm_models.masks import padding_mask
from mlx_dllm_models.models import dream
from mlx_dllm_models.settings import family_settings
from mlx_dllm_models.spec import BIDIRECTIONAL
from reference.dream_torch import dream_generate, reference_forward, reference_logits


@pytest.fixture(scope="module")
def ckpt(fixture_dir):
    return build_once(fixture_dir / "dream", build)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_fixture(ckpt)[0]


def canvas(batch, length, prompt, seed):
    """Random prompt ids followed by mask tokens, as Dream's generator lays out its canvas."""
    ids = np.random.default_rng(seed).integers(0, 256, (batch, length))
    ids[:, prompt:] = MASK
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("length", [1, 7, 16, 33])
def test_logits_match_bidirectional_reference(model, ckpt, length):
    ids = canvas(2, length, max(1, length // 2), seed=length)
    ours = model(mx.array(ids))
    ref = reference_logits(ckpt, ids)
    assert_close(ours, ref)
    if length > 1:
        # A causal model (Qwen2's default reading) must not pass the same check.
        assert far(ours, reference_logits(ckpt, ids, causal=True))


def test_causal_mask_argument_matches_causal_reference(model, ckpt):
    ids = canvas(2, 12, 6, seed=3)
    assert_close(model(mx.array(ids), mask="causal"), reference_logits(ckpt, ids, causal=True))


def test_rows_slice_hidden_states_before_the_head(model):
    ids = mx.array(canvas(2, 20, 8, seed=4))
    full = model(ids)
    part = model(ids, head_span=(7, 15))
    assert part.shape == (2, 8, full.shape[-1])
    assert_close(part, full[:, 7:15])


def test_left_padding_matches_unpadded_prompt_and_reference(model, ckpt):
    # Row 0 unpadded, row 1 left-padded by 5 with Dream's pad (<|endoftext|>).
    pads = [0, 5]
    length = 18
    ids = canvas(2, length, 10, seed=5)
    ids[1, : pads[1]] = ENDOFTEXT
    attention = np.ones((2, length), np.int64)
    attention[1, : pads[1]] = 0

    mask = padding_mask(pads, length)
    cache = Positions.for_left_padding(pads, len(model.layers))
    ours = np.array(model(mx.array(ids), cache=cache, mask=mask))

    alone = np.array(model(mx.array(ids[1:, pads[1] :])))
    assert_close(ours[1, pads[1] :], alone[0])
    assert_close(ours[0], np.array(model(mx.array(ids[:1])))[0])

    ref = reference_logits(ckpt, ids, attention_mask=attention)
    assert_close(ours[0], ref[0])
    assert_close(ours[1, pads[1] :], ref[1, pads[1] :])

    # Attending to the pads does not pass. (Positions alone cannot be caught here: with the pads
    # masked out, RoPE scores depend only on relative positions.)
    assert far(np.array(model(mx.array(ids)))[1, pads[1] :], ref[1, pads[1] :])


def test_shift_logits_is_dreams_alignment():
    logits = mx.arange(2 * 4 * 3).reshape(2, 4, 3)
    shifted = np.array(dream.shift_logits(logits))
    ref = np.array(logits)
    assert (shifted[:, 0] == ref[:, 0]).all()
    assert (shifted[:, 1:] == ref[:, :-1]).all()


def test_diffusion_spec_from_config(model, ckpt):
    spec = model.diffusion_spec
    cfg = json.loads((ckpt / "config.json").read_text())
    assert spec.family == "dream" and spec.attention == BIDIRECTIONAL
    assert spec.mask_token_id == cfg["mask_token_id"] == MASK
    assert spec.eos_token_ids == (ENDOFTEXT,)
    assert spec.logit_shift == 1 and spec.confidence == "sampled" and spec.quota_base == "masks"
    assert spec.samplers == ("dream", "d3llm", "quota", "threshold", "factor", "entropy")
    d3llm = {"block_size", "block_add_threshold", "decoded_token_threshold", "early_stop"}
    # alg_p_threshold: Dimple's (a Dream-family checkpoint), with its sampler "dimple" only.
    dimple = {"alg_p_threshold"}
    assert set(family_settings(spec.family)) == {"alg", "alg_temp", "eps"} | d3llm | dimple
    # Dream README recipe (issue #12): alg entropy; eps as diffusion_generate.
    assert spec.defaults["alg"] == "entropy" and spec.defaults["eps"] == 1e-3
    assert spec.max_position_embeddings == cfg["max_position_embeddings"]


def test_missing_mask_token_id_is_a_clear_error(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["mask_token_id"]
    m = dream.Model(dream.ModelArgs.from_dict(cfg))
    with pytest.raises(ValueError, match="mask_token_id"):
        m.diffusion_spec


def test_sanitize_rejects_weights_without_qkv_bias(ckpt):
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    m = dream.Model(dream.ModelArgs.from_dict(cfg))
    weights = load_file(str(ckpt / "model.safetensors"))
    del weights["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match="k_proj.bias"):
        m.sanitize(weights)


def test_reference_generator_runs_on_the_fixture(ckpt):
    """Smoke check of the transcribed sampling loop the engine's token-parity tests will use."""
    prompt = canvas(2, 6, 6, seed=7)
    seq = dream_generate(
        reference_forward(ckpt),
        prompt,
        max_new_tokens=8,
        steps=4,
        alg="maskgit_plus",
        mask_token_id=MASK,
    )
    assert seq.shape == (2, 14)
    assert (seq[:, :6] == prompt).all() and not (seq == MASK).any()
