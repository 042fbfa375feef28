"""`model(ids)` with no mask computes what the upstream model's own forward computes (issue 43):
WeDLM's WeDLMForCausalLM.forward is Qwen's causal one, and so is Open-dCoder's (veomni's Qwen2
forward defaults to is_causal=True; its sampler passes False); Fast-dLLM v2's eval-mode forward is
block-causal over blocks of 32 (its `block_size` argument's default); LLaDA's, Dream's, CoDA's
(attention.py: SDPA with is_causal=False, no mask), RND1's (modeling_rnd.py: is_causal=False) and
dllm's A2D (A2DQwen3Model / A2DQwen2Model: the padding mask only) forwards attend bidirectionally;
Nemotron's forward defaults to use_causal_mask=False; LLaDA2's (modeling_llada2_moe.py under
transformers' default SDPA) passes no mask and is_causal=False, so every key; SDAR's eval forward
(JetAstra/SDAR modeling_sdar.py) takes the caller's mask, reads an all-true one with flash
attention's causal=False and has no reading of a missing one (torch.all(None) raises), so the
plain call is its all-true reading; BD3-LM's forward over L tokens (sample_mode, no KV cache) is
block-causal from position 0 (the x0 half of block_diff_mask). Each plain call is held against the
reference's plain forward on a fixture in the real layout, and against another reading, so that
the comparison can fail. Of the vision families, Dimple's text forward (DimpleModel.forward: Dream's
bidirectional body with Qwen2-VL's M-RoPE) is checked; DiffusionGemma, LLaDA-V, LaViDa and
Nemotron-VLM have no plain-ids reference forward here (not checked)."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_block_models_forward import mlx_vlm_language_model

from fixtures import bd3lm as bd3lm_fixture
from fixtures import build_once
from fixtures import coda as coda_fixture
from fixtures import dimple as dimple_fixture
from fixtures import dllm as a2d_fixture
from fixtures import dllm_qwen2 as a2d_qwen2_fixture
from fixtures import dream as dream_fixture
from fixtures import fast_dllm_v2 as fast_dllm_fixture
from fixtures import llada2 as llada2_fixture
from fixtures import nemotron as nemotron_fixture
from fixtures import open_dcoder as open_dcoder_fixture
from fixtures import rnd1 as rnd1_fixture
from fixtures import sdar as sdar_fixture
from fixtures import wedlm as wedlm_fixture
from fixtures.llada import CHECKPOINTS as LLADA_CHECKPOINTS
from helpers import assert_close, far, load_fixture
from mlx_dllm_models.masks import block_causal_mask, causal_mask
from reference import (
    coda_torch,
    dimple_torch,
    dllm_a2d,
    dream_torch,
    fast_dllm_v2_torch,
    llada_torch,
    open_dcoder_torch,
    rnd1_sampling,
    sdar_torch,
    wedlm_torch,
)
from reference.bd3lm_torch import BD3LMReference

# transformers warns about the `rope_scaling: null` that LLaDA-MoE's config.json carries.
pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")


def ids(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (1, n))


def plain(model, x):
    return np.array(model(mx.array(x)).astype(mx.float32))


# Fixture name -> (builder, reference module whose load_reference(ckpt) is transformers' model
# of the checkpoint, called here as upstream's plain forward: no attention mask).
CAUSAL = {
    "wedlm_qwen3": (wedlm_fixture.build, wedlm_torch),
    "wedlm_qwen2": (wedlm_fixture.build_qwen2, wedlm_torch),
    "open_dcoder": (open_dcoder_fixture.build_converted, open_dcoder_torch),
}


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_plain_call_is_its_forward(fixture_dir, name):
    builder, reference = CAUSAL[name]
    ckpt = build_once(fixture_dir / name, builder)
    model = load_fixture(ckpt)[0]
    x = ids(13, 3)
    with torch.no_grad():
        out = reference.load_reference(str(ckpt))(input_ids=torch.as_tensor(x).long())
    want = out.logits.float().numpy()
    got = plain(model, x)
    assert_close(got, want)
    assert far(got, plain_every_key(model, x))
    # A shorter row, and a head span, read the same causal forward.
    assert_close(np.array(model(mx.array(x[:, :5]))), want[:, :5])
    assert_close(np.array(model(mx.array(x), head_span=(4, 9))), want[:, 4:9])


def plain_every_key(model, x):
    every = mx.ones((1, 1, x.shape[1], x.shape[1]), dtype=mx.bool_)
    return np.array(model(mx.array(x), mask=every).astype(mx.float32))


# Fixture name -> (builder, reference module with reference_logits(ckpt, ids, causal=...)).
BIDIRECTIONAL = {
    "llada": (LLADA_CHECKPOINTS["llada"], llada_torch),
    "llada_moe": (LLADA_CHECKPOINTS["llada_moe"], llada_torch),
    "dream": (dream_fixture.build, dream_torch),
    "coda": (coda_fixture.build, coda_torch),
    "rnd1": (rnd1_fixture.build, rnd1_sampling),
    "a2d_qwen3": (a2d_fixture.build, dllm_a2d),
    "a2d_qwen2": (a2d_qwen2_fixture.build, dllm_a2d),
}


@pytest.mark.parametrize("name", sorted(BIDIRECTIONAL))
def test_bidirectional_plain_call_is_its_forward(fixture_dir, name):
    builder, reference = BIDIRECTIONAL[name]
    ckpt = build_once(fixture_dir / name, builder)
    model = load_fixture(ckpt)[0]
    x = ids(11, 5)
    got = plain(model, x)
    assert_close(got, reference.reference_logits(ckpt, x))
    assert far(got, reference.reference_logits(ckpt, x, causal=True))


def test_fast_dllm_v2_plain_call_is_its_block_causal_forward(fixture_dir):
    """Across a block boundary (40 tokens: blocks of 32): the upstream forward without a cache."""
    ckpt = build_once(fixture_dir / "fast_dllm_v2", fast_dllm_fixture.build)
    model = load_fixture(ckpt)[0]
    x = ids(40, 9)
    reference = fast_dllm_v2_torch.Reference(ckpt)
    with torch.no_grad():
        want = reference.forward(torch.as_tensor(x).long()).float().numpy()
    got = plain(model, x)
    assert_close(got, want)
    assert far(got[:, :32], plain_every_key(model, x)[:, :32])


@pytest.mark.parametrize("name", sorted(sdar_fixture.CHECKPOINTS))
def test_sdar_plain_call_is_its_all_true_reading(fixture_dir, name):
    """Across block boundaries (blocks of 4): every key, not the block-causal decoding mask."""
    ckpt = build_once(fixture_dir / name, sdar_fixture.CHECKPOINTS[name])
    model = load_fixture(ckpt)[0]
    x = ids(10, 7)
    block = sdar_fixture.BLOCK_SIZE
    got = plain(model, x)
    assert_close(got, sdar_torch.reference_logits(ckpt, x, block, layout="full"))
    assert far(got, sdar_torch.reference_logits(ckpt, x, block))


def test_llada2_plain_call_attends_to_every_key(fixture_dir):
    """Upstream's forward under transformers' default SDPA: no mask, is_causal=False."""
    ckpt = build_once(fixture_dir / "llada2_moe", llada2_fixture.build)
    model = load_fixture(ckpt)[0]
    x = ids(40, 11)  # two blocks of 32
    reference = mlx_vlm_language_model(ckpt)
    got = plain(model, x)
    assert_close(got, reference(mx.array(x)).logits)
    keep = block_causal_mask(40, llada2_fixture.BLOCK_LENGTH)
    assert far(got, np.array(reference(mx.array(x), mask=keep).logits))


def test_nemotron_plain_call_is_its_default_bidirectional_forward(fixture_dir):
    ckpt = build_once(fixture_dir / "nemotron", nemotron_fixture.build)
    model = load_fixture(ckpt)[0]
    x = ids(20, 13)
    reference = nemotron_fixture.mlx_vlm_model(ckpt)
    got = plain(model, x)
    assert_close(got, reference(mx.array(x), use_causal_mask=False).logits)
    assert far(got, np.array(reference(mx.array(x), use_causal_mask=True).logits))


def test_bd3lm_plain_call_is_its_block_causal_sampling_forward(fixture_dir):
    ckpt = build_once(fixture_dir / "bd3lm", bd3lm_fixture.build)
    model = load_fixture(ckpt)[0]
    cfg = json.loads((ckpt / "config.json").read_text())
    reference = BD3LMReference(load_file(str(ckpt / "model.safetensors")), cfg)
    x = ids(10, 17)  # blocks of 4
    got = plain(model, x)
    assert_close(got, reference.forward(torch.as_tensor(x).long()).float().numpy())
    assert far(got, plain_every_key(model, x))


def test_dimple_plain_call_is_its_bidirectional_forward(fixture_dir):
    ckpt = build_once(fixture_dir / "dimple", dimple_fixture.build)
    model = load_fixture(ckpt)[0]
    x = ids(12, 19)
    got = plain(model, x)
    with torch.no_grad():
        assert_close(got, dimple_torch.logits(ckpt, x).float().numpy())
    causal = np.array(model(mx.array(x), mask=causal_mask(12)).astype(mx.float32))
    assert far(got, causal)
