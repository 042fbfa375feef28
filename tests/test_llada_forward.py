"""LLaDA 8B and LLaDA-MoE forward pass: parity with transformers (Llama / Qwen3-MoE on renamed
weights, read bidirectionally), the `rows` slice, the spec, and clear errors on bad input."""

import json

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures.llada import CHECKPOINTS, LLADA_TOKENS, llada_moe_arrays
from helpers import assert_close, far, load_fixture
from mlx_dllm_models.cache import Positions
from mlx_dllm_models.engine import cache_choices
from mlx_dllm_models.masks import causal_mask, padding_mask
from mlx_dllm_models.models import llada, llada_moe
from mlx_dllm_models.spec import BIDIRECTIONAL
from reference.llada_torch import llada_generate, reference_logits, torch_forward

VARIANTS = ("llada", "llada_moe")

# transformers warns about the `rope_scaling: null` that LLaDA-MoE's config.json carries.
pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def ckpts(fixture_dir):
    return {name: build_once(fixture_dir / name, CHECKPOINTS[name]) for name in VARIANTS}


@pytest.fixture(scope="module")
def models(ckpts):
    return {name: load_fixture(path)[0] for name, path in ckpts.items()}


def canvas(model, length, seed, batch=2):
    """Random token rows with a tail of masks, as the engine's forwards see them."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 300, size=(batch, length))
    ids[:, length // 2 :] = model.diffusion_spec.mask_token_id
    return ids


def logits(model, ids, **kw):
    return np.array(model(mx.array(ids), **kw).astype(mx.float32))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("length", [1, 7, 33])
def test_forward_matches_transformers_bidirectional(models, ckpts, name, length):
    model = models[name]
    ids = canvas(model, length, seed=length)
    assert_close(logits(model, ids), reference_logits(ckpts[name], ids))


@pytest.mark.parametrize("name", VARIANTS)
def test_causal_reading_does_not_match(models, ckpts, name):
    """The parity test can fail: a causal reading of the same weights gives other logits, and our
    causal path matches transformers' causal one."""
    model = models[name]
    ids = canvas(model, 24, seed=5)
    bidirectional = reference_logits(ckpts[name], ids)
    causal = reference_logits(ckpts[name], ids, causal=True)
    assert far(causal, bidirectional)
    assert far(logits(model, ids), causal)
    assert_close(logits(model, ids, mask="causal"), causal)
    assert_close(logits(model, ids, mask=causal_mask(24)), causal)


@pytest.mark.parametrize("name", VARIANTS)
def test_left_padding_through_the_protocol(models, name):
    """Per-row RoPE offsets (cache.offset as a (B,) array) and a boolean keep-mask: a left-padded
    row reads exactly like the same row unpadded."""
    model = models[name]
    ids = canvas(model, 12, seed=9, batch=1)
    pad = 5
    padded = np.concatenate([np.full((1, pad), 301), ids], axis=1)
    batch = np.concatenate([padded, np.concatenate([ids[:, :pad], ids], axis=1)], axis=0)
    cache = Positions.for_left_padding([pad, 0], len(model.layers))
    got = logits(model, batch, cache=cache, mask=padding_mask([pad, 0], 12 + pad))
    assert_close(got[:1, pad:], logits(model, ids))


@pytest.mark.parametrize("name", VARIANTS)
def test_rows_is_a_slice_of_the_full_logits(models, name):
    model = models[name]
    ids = canvas(model, 20, seed=3)
    full = logits(model, ids)
    for rows in [(0, 20), (10, 20), (4, 9), (19, 20)]:
        part = logits(model, ids, head_span=rows)
        assert part.shape == (2, rows[1] - rows[0], full.shape[-1])
        np.testing.assert_allclose(part, full[:, rows[0] : rows[1]], rtol=1e-5, atol=1e-5)


def test_spec_reads_the_config(models):
    spec = models["llada"].diffusion_spec
    assert spec.family == "llada" and spec.attention == BIDIRECTIONAL and spec.logit_shift == 0
    assert spec.mask_token_id == LLADA_TOKENS["<|mdm_mask|>"]
    assert spec.eos_token_ids == (LLADA_TOKENS["<|endoftext|>"],)
    assert spec.confidence == "raw" and spec.quota_base == "masks"
    # No exact cache for bidirectional attention: Fast-dLLM's and Dimple's approximate ones, opt-in.
    assert cache_choices(spec.attention) == ("auto", "dual", "none", "prefill", "prefix")
    assert spec.defaults["block_length"] == 32 and "steps" not in spec.defaults
    assert spec.max_position_embeddings == 4096
    moe = models["llada_moe"]
    assert moe.args.is_moe and moe.diffusion_spec.max_position_embeddings == 8192


def test_fixtures_are_confident(models):
    """A useful share of mask positions passes 0.9 and predictions vary across positions."""
    for model in models.values():
        ids = canvas(model, 48, seed=11, batch=1)
        p = mx.softmax(model(mx.array(ids))[0, 24:], axis=-1)
        conf = np.array(p.max(axis=-1))
        assert 0.2 <= (conf > 0.9).mean() <= 0.95
        assert len(set(np.array(p.argmax(axis=-1)).tolist())) >= 6


def _config(ckpt):
    return json.loads((ckpt / "config.json").read_text())


def _hf_weights(ckpt):
    return dict(mx.load(str(ckpt / "model.safetensors")))


@pytest.mark.parametrize("name", VARIANTS)
def test_sanitize_rejects_an_unknown_key(ckpts, name):
    model = llada.Model(llada.ModelArgs.from_dict(_config(ckpts[name])))
    weights = _hf_weights(ckpts[name])
    bad = {
        "llada": "model.transformer.blocks.0.att_proj.weight",
        "llada_moe": "model.layers.0.mlp.router.weight",
    }[name]
    weights[bad] = mx.zeros((4, 4))
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        model.sanitize(weights)


def test_sanitize_rejects_a_shape_mismatch(ckpts):
    cfg = _config(ckpts["llada"])
    cfg["mlp_hidden_size"] = 192
    model = llada.Model(llada.ModelArgs.from_dict(cfg))
    hf_name = r"'model\.transformer\.blocks\.\d\.(ff_proj|up_proj|ff_out)\.weight' has shape"
    with pytest.raises(ValueError, match=hf_name):
        model.sanitize(_hf_weights(ckpts["llada"]))


def test_sanitize_maps_every_hf_name_and_is_idempotent(ckpts):
    for name in VARIANTS:
        model = llada.Model(llada.ModelArgs.from_dict(_config(ckpts[name])))
        weights = model.sanitize(_hf_weights(ckpts[name]))
        model.load_weights(list(weights.items()), strict=True)
        # A converted checkpoint (our names) goes through sanitize unchanged.
        again = model.sanitize(dict(weights))
        assert set(again) == set(weights)


def test_model_args_need_a_mask_token(ckpts):
    cfg = _config(ckpts["llada"])
    del cfg["mask_token_id"]
    with pytest.raises(ValueError, match="checkpoint has no mask_token_id; add it to config.json"):
        llada.ModelArgs.from_dict(cfg)


def test_moe_mask_token_defaults_to_its_generate_s():
    """LLaDA-MoE's config.json, as quoted, names no mask_token_id: its generate's 156895."""
    cfg, _ = llada_moe_arrays()
    del cfg["mask_token_id"]
    cfg["vocab_size"] = 157184
    assert llada.ModelArgs.from_dict(cfg).mask_token_id == 156895
    cfg["mask_token_id"] = 303  # a config that names one keeps it
    assert llada.ModelArgs.from_dict(cfg).mask_token_id == 303


@pytest.mark.slow
def test_moe_router_expert_bias_and_shared_expert():
    """The LLaDA-MoE block as its remote code writes it: softmax in float32, expert bias added to
    the probabilities (biased values rank and weight), no renormalisation; shared expert added."""
    cfg, _ = llada_moe_arrays()
    cfg = dict(cfg, moe_router_enable_expert_bias=True, shared_expert_intermediate_size=64)
    args = llada.ModelArgs.from_dict(cfg)
    layer = llada_moe.MoEDecoderLayer(args, 1)
    rng = np.random.default_rng(7)
    bias = rng.standard_normal(args.num_experts).astype(np.float32) * 0.3
    layer.mlp.expert_bias = mx.array(bias)
    x = rng.standard_normal((1, 5, args.hidden_size)).astype(np.float32)

    def np_mlp(h, g, u, d):
        a = h @ g.T
        return ((a / (1 + np.exp(-a))) * (h @ u.T)) @ d.T

    gate = np.array(layer.mlp.gate.weight)
    sw = layer.mlp.switch_mlp
    G, U, D = (np.array(m.weight) for m in (sw.gate_proj, sw.up_proj, sw.down_proj))
    logits_ = x[0] @ gate.T
    probs = np.exp(logits_ - logits_.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True) + bias
    want = np.zeros_like(x[0])
    for t in range(x.shape[1]):
        for e in np.argsort(-probs[t])[: args.num_experts_per_tok]:
            want[t] += probs[t, e] * np_mlp(x[0, t], G[e], U[e], D[e])
    se = layer.shared_expert
    want += np_mlp(x[0], *(np.array(m.weight) for m in (se.gate_proj, se.up_proj, se.down_proj)))

    r = mx.array(x)
    got = layer.mlp(r) + layer.shared_expert(r)
    np.testing.assert_allclose(np.array(got)[0], want, rtol=1e-4, atol=1e-4)
    # The same call path as the decoder layer uses it, with a shared expert the config asked for.
    assert "shared_expert" in layer and "expert_bias" in layer.mlp


def test_reference_generate_transcription(ckpts):
    """The torch transcription of LLaDA's generate: quota mode does `steps` forwards and fills the
    canvas; the threshold rule commits at least one token per forward and needs fewer forwards."""
    forward = torch_forward(ckpts["llada"])
    prompt = np.array([[LLADA_TOKENS["<|startoftext|>"], 72, 105, 33]])
    mask_id = LLADA_TOKENS["<|mdm_mask|>"]
    out, nfe = llada_generate(forward, prompt, 8, 16, 8, mask_id=mask_id, return_nfe=True)
    assert nfe == 8 and (out[:, 4:] != mask_id).all() and (out[:, :4] == prompt).all()
    out_t, nfe_t = llada_generate(
        forward, prompt, 8, 16, 8, mask_id=mask_id, threshold=0.9, return_nfe=True
    )
    assert (out_t[:, 4:] != mask_id).all() and nfe_t <= 16
    # A threshold nothing passes commits exactly one token per forward.
    _, nfe_one = llada_generate(
        forward, prompt, 8, 16, 8, mask_id=mask_id, threshold=1.1, return_nfe=True
    )
    assert nfe_one == 16
