"""Block-diffusion model classes (SDAR, SDAR-MoE, LLaDA2-MoE): forward parity under the block-causal
mask against independent implementations, router semantics, sanitize and quantization hooks."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from block_checks import mlx_vlm_language_model, read_weights
from fixtures import build_once
from fixtures import llada2 as llada2_fixture
from fixtures import sdar as sdar_fixture
from helpers import assert_close, far, load_fixture
from mlx_dllm_models.masks import block_causal_mask, causal_mask
from mlx_dllm_models.models import llada2_moe, sdar, sdar_moe
from mlx_dllm_models.settings import family_settings
from mlx_dllm_models.spec import BLOCK_CAUSAL, SHARED_SAMPLERS
from reference.sdar_torch import reference_logits


def canvas(batch, length, prompt, mask_id, seed):
    """Random prompt ids followed by mask tokens."""
    ids = np.random.default_rng(seed).integers(0, 256, (batch, length))
    ids[:, prompt:] = mask_id
    return ids


def build_direct(module, path, weights=None):
    """Model built straight from config.json and (possibly edited) weights, bypassing mlx-lm's loader."""
    cfg = json.loads((path / "config.json").read_text())
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(dict(weights or read_weights(path))).items()))
    return model


@pytest.fixture(scope="module")
def checkpoints(fixture_dir):
    def get(name, builder, **kw):
        return build_once(fixture_dir / name, builder, **kw)

    return {
        "sdar": get("sdar", sdar_fixture.build_sdar),
        "sdar_moe": get("sdar_moe", sdar_fixture.build_sdar_moe),
        "llada2_moe": get("llada2_moe", llada2_fixture.build),
        # head_dim (32) != hidden_size / num_attention_heads (16), as in the real LLaDA2 / SDAR.
        "llada2_moe_hd32": get("llada2_moe_hd32", llada2_fixture.build, head_dim=32),
    }


@pytest.fixture(scope="module")
def models(checkpoints):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_fixture(checkpoints[name])[0]
        return cache[name]

    return get


# ------------------------------------------------------------------------------------------- SDAR


@pytest.mark.parametrize("name", ["sdar", "sdar_moe"])
@pytest.mark.parametrize("length,prompt", [(12, 8), (11, 6)])  # block-aligned and not aligned
def test_sdar_matches_transformers_qwen3_under_block_causal_mask(
    models, checkpoints, name, length, prompt
):
    model = models(name)
    block = sdar_fixture.BLOCK_SIZE
    ids = canvas(2, length, prompt, sdar_fixture.MASK, seed=length)
    ours = model(mx.array(ids), mask=block_causal_mask(length, block))
    ref = reference_logits(checkpoints[name], ids, block)
    assert_close(ours, ref)
    # A wrong attention layout must not pass the same check.
    assert far(ours, reference_logits(checkpoints[name], ids, block, layout="causal"))
    assert far(ours, reference_logits(checkpoints[name], ids, block, layout="full"))


@pytest.mark.parametrize("name", ["sdar", "sdar_moe", "llada2_moe"])
def test_rows_and_prefix_cache_follow_the_protocol(models, name):
    from mlx_lm.models.cache import KVCache

    model = models(name)
    block = model.diffusion_spec.trained_block_length
    length, prefix = 3 * block - 1, 2 * block
    ids = mx.array(canvas(1, length, prefix + 1, model.diffusion_spec.mask_token_id, seed=3))
    full = model(ids, mask=block_causal_mask(length, block))
    assert_close(
        model(ids, mask=block_causal_mask(length, block), head_span=(prefix, length)),
        full[:, prefix:],
    )
    # Finished blocks in a KV cache, then the open block at absolute positions prefix..length-1.
    # mlx-lm's KV cache (make_prompt_cache refuses masked-diffusion models: make_cache raises).
    cache = [KVCache() for _ in model.layers]
    model(ids[:, :prefix], cache=cache, mask=block_causal_mask(prefix, block))
    tail = model(
        ids[:, prefix:], cache=cache, mask=block_causal_mask(length - prefix, block, offset=prefix)
    )
    assert_close(tail, full[:, prefix:])


def test_sdar_spec_and_mask_token_resolution(models):
    spec = models("sdar").diffusion_spec
    assert spec.attention == BLOCK_CAUSAL
    assert spec.mask_token_id == sdar_fixture.MASK
    # mlx-lm's load_config puts generation_config.json's eos list into the config.
    assert spec.eos_token_ids == (sdar_fixture.IM_END, sdar_fixture.ENDOFTEXT)
    assert spec.trained_block_length == spec.defaults["block_length"] == 4
    assert "steps" not in spec.defaults  # steps follow block_length
    assert spec.samplers == SHARED_SAMPLERS + ("sequential", "entropy_bounded")
    assert spec.confidence == "sampled" and spec.quota_base == "block"
    assert models("sdar_moe").diffusion_spec == spec

    cfg = sdar_fixture.sdar_config(moe=False)
    del cfg["mask_token_id"], cfg["block_size"]
    with pytest.raises(ValueError, match="mask_token_id 151669 is outside the vocabulary"):
        sdar.ModelArgs.from_dict(cfg)
    cfg["vocab_size"] = 151936  # the real SDAR vocabulary: the documented default applies
    args = sdar.ModelArgs.from_dict(cfg)
    assert (args.mask_token_id, args.block_size) == (151669, 4)


# ----------------------------------------------------------------------------------------- LLaDA2


@pytest.mark.parametrize("name", ["llada2_moe", "llada2_moe_hd32"])
@pytest.mark.parametrize("length,prompt", [(64, 40), (75, 45)])  # block-aligned and not aligned
def test_llada2_matches_mlx_vlm_under_block_causal_mask(models, checkpoints, name, length, prompt):
    model = models(name)
    reference = mlx_vlm_language_model(checkpoints[name])
    block = llada2_fixture.BLOCK_LENGTH
    ids = mx.array(canvas(1, length, prompt, llada2_fixture.MASK, seed=length))
    mask = block_causal_mask(length, block)
    ours = model(ids, mask=mask)
    assert_close(ours, reference(ids, mask=mask).logits)
    assert far(ours, reference(ids, mask=causal_mask(length)).logits)
    assert far(ours, reference(ids).logits)  # no mask: bidirectional


def bailing_logits(path, weights, ids, mask):
    """mlx-lm's bailing_moe (the Ling 2.0 body) on the same weights; its Model builds a causal mask
    itself, so the layers are run with the block-causal one."""
    from mlx_lm.models import bailing_moe

    model = build_direct(bailing_moe, path, weights)
    h = model.model.word_embeddings(ids)
    for layer in model.model.layers:
        h = layer(h, mask, None)
    return model.lm_head(model.model.norm(h))


def test_llada2_router_drops_groups_with_minus_inf_not_zero(models, checkpoints):
    path = checkpoints["llada2_moe"]
    ids = mx.array(canvas(1, 48, 30, llada2_fixture.MASK, seed=7))
    mask = block_causal_mask(48, llada2_fixture.BLOCK_LENGTH)
    weights = read_weights(path)
    # The fixture's negative expert biases push routing scores below 0, where bailing_moe's 0 for a
    # dropped group outranks the kept experts: the two routers pick different experts.
    assert far(models("llada2_moe")(ids, mask=mask), bailing_logits(path, weights, ids, mask))
    # With positive biases the scores of kept groups stay above 0 and the two routers agree, so
    # the group drop is the only difference.
    positive = {k: mx.abs(v) + 0.5 if k.endswith("expert_bias") else v for k, v in weights.items()}
    ours = build_direct(llada2_moe, path, positive)(ids, mask=mask)
    assert_close(ours, bailing_logits(path, positive, ids, mask))


def test_llada2_quantization_keeps_router_in_float(checkpoints):
    from mlx_lm.utils import quantize_model

    path = checkpoints["llada2_moe"]
    bf16 = {k: v.astype(mx.bfloat16) for k, v in read_weights(path).items()}
    model = build_direct(llada2_moe, path, bf16)
    assert model.model.layers[1].mlp.gate.expert_bias.dtype == mx.float32  # sanitize upcasts it
    assert not model.cast_predicate("model.layers.1.mlp.gate.expert_bias")
    cfg = json.loads((path / "config.json").read_text())
    quantize_model(model, cfg, group_size=64, bits=4)
    layer = model.model.layers[1]
    assert isinstance(layer.attention.query_key_value, nn.QuantizedLinear)  # quantization did run
    assert type(layer.mlp.gate.gate_proj) is nn.Linear
    assert layer.mlp.gate.expert_bias.dtype == mx.float32


def test_llada2_spec(models):
    spec = models("llada2_moe").diffusion_spec
    assert spec.attention == BLOCK_CAUSAL
    assert (spec.mask_token_id, spec.eos_token_ids) == (llada2_fixture.MASK, (llada2_fixture.EOS,))
    assert spec.trained_block_length == spec.defaults["block_length"] == 32
    assert spec.defaults["threshold"] == 0.95 and spec.defaults["max_post_steps"] == 16
    assert family_settings(spec.family) == ("editing_mode", "editing_threshold", "max_post_steps")
    cfg = llada2_fixture.config()
    cfg["block_length"] = 16
    args = llada2_moe.ModelArgs.from_dict(cfg)
    assert args.rotary_dim == 8 and args.head_dim == 16
    assert llada2_moe.Model(args).diffusion_spec.trained_block_length == 16


# ---------------------------------------------------------------------------------------- sanitize


@pytest.mark.parametrize(
    "name,module,stray",
    [
        ("sdar", sdar, "model.layers.0.self_attn.q_bias.weight"),
        ("sdar_moe", sdar_moe, "model.layers.0.mlp.shared_expert.up_proj.weight"),
        ("llada2_moe", llada2_moe, "model.layers.1.mlp.gate.e_score_correction_bias"),
    ],
)
def test_sanitize_names_unknown_weights(checkpoints, name, module, stray):
    path = checkpoints[name]
    weights = read_weights(path)
    weights[stray] = mx.zeros((4,))
    with pytest.raises(ValueError, match="do not belong to this architecture") as err:
        build_direct(module, path, weights)
    assert stray in str(err.value)
