"""`model(ids)` with no mask computes what the upstream model's own forward computes (issue 43):
WeDLM's WeDLMForCausalLM.forward is Qwen's causal one, and so is Open-dCoder's (veomni's Qwen2
forward defaults to is_causal=True; its sampler passes False); Fast-dLLM v2's eval-mode forward is
block-causal over blocks of 32 (its `block_size` argument's default); LLaDA's and Dream's remote
forwards attend bidirectionally. Each plain call is held against the reference's plain forward on
a fixture in the real layout, and against another reading, so that the comparison can fail."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures import dream as dream_fixture
from fixtures import fast_dllm_v2 as fast_dllm_fixture
from fixtures import open_dcoder as open_dcoder_fixture
from fixtures import wedlm as wedlm_fixture
from fixtures.llada import CHECKPOINTS as LLADA_CHECKPOINTS
from helpers import assert_close, far, load_fixture
from reference import (
    dream_torch,
    fast_dllm_v2_torch,
    llada_torch,
    open_dcoder_torch,
    wedlm_torch,
)

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
