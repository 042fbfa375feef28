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
bidirectional body with Qwen2-VL's M-RoPE) is checked here; DiffusionGemma, LLaDA-V, LaViDa and
Nemotron-VLM are in tests/test_plain_forward_vision.py. The families added since hold theirs in
their own files: DMax here (llada2_moe's call), Stable-DiffCoder in its conformance row
(tests/test_conformance.py), LLaDA2.2 in tests/test_llada22_block_routing.py, GIDD in
tests/test_gidd.py, SDAR-VL and Lumina-DiMOO in tests/test_plain_forward_vision.py."""

import json
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from block_checks import mlx_vlm_language_model
from fixtures import bd3lm as bd3lm_fixture
from fixtures import build_once
from fixtures import coda as coda_fixture
from fixtures import dimple as dimple_fixture
from fixtures import dllm as a2d_fixture
from fixtures import dllm_qwen2 as a2d_qwen2_fixture
from fixtures import dmax as dmax_fixture
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


def every_key(ckpt, model, x):
    every = mx.ones((1, 1, x.shape[1], x.shape[1]), dtype=mx.bool_)
    return np.array(model(mx.array(x), mask=every).astype(mx.float32))


def torch_plain(reference):
    """Upstream's plain forward: `reference.load_reference(ckpt)`, transformers' model of the
    checkpoint, called with no attention mask."""

    def logits(ckpt, x):
        with torch.no_grad():
            out = reference.load_reference(str(ckpt))(input_ids=torch.as_tensor(x).long())
        return out.logits.float().numpy()

    return logits


def reference_logits(reference, **kw):
    """`reference.reference_logits(ckpt, ids, **kw)` as a (ckpt, ids) reading."""
    return lambda ckpt, x: reference.reference_logits(ckpt, x, **kw)


def fast_dllm_v2_forward(ckpt, x):
    """The upstream forward without a cache."""
    with torch.no_grad():
        return fast_dllm_v2_torch.Reference(ckpt).forward(torch.as_tensor(x).long()).float().numpy()


@lru_cache(maxsize=1)
def llada2_reference(ckpt):
    return mlx_vlm_language_model(ckpt)


def llada2_forward(ckpt, x, mask=None):
    """Upstream's forward under transformers' default SDPA: no mask, is_causal=False."""
    kw = {} if mask is None else {"mask": mask}
    return np.array(llada2_reference(ckpt)(mx.array(x), **kw).logits)


def nemotron_forward(ckpt, x, causal=False):
    return np.array(
        nemotron_fixture.mlx_vlm_model(ckpt)(mx.array(x), use_causal_mask=causal).logits
    )


def bd3lm_forward(ckpt, x):
    cfg = json.loads((ckpt / "config.json").read_text())
    reference = BD3LMReference(load_file(str(ckpt / "model.safetensors")), cfg)
    return reference.forward(torch.as_tensor(x).long()).float().numpy()


def dimple_forward(ckpt, x):
    with torch.no_grad():
        return dimple_torch.logits(ckpt, x).float().numpy()


def causal_call(ckpt, model, x):
    return np.array(model(mx.array(x), mask=causal_mask(x.shape[1])).astype(mx.float32))


def ckpt_reading(forward):
    """A reading of the checkpoint alone, `forward(ckpt, ids)`, as a (ckpt, model, ids) one."""
    return lambda ckpt, model, x: forward(ckpt, x)


SDAR_BLOCK = sdar_fixture.BLOCK_SIZE


# Fixture name -> (builder, ids' length and seed, upstream's plain forward `(ckpt, ids) ->
# logits`, and another reading `(ckpt, model, ids) -> logits` that the plain call must be far from
# over its columns, so that the comparison can fail). The causal rows (WeDLM, Open-dCoder) are
# also read over a shorter row and a head span.
CAUSAL = {"wedlm_qwen3", "wedlm_qwen2", "open_dcoder"}
ROWS = {
    "wedlm_qwen3": (wedlm_fixture.build, 13, 3, torch_plain(wedlm_torch), every_key),
    "wedlm_qwen2": (wedlm_fixture.build_qwen2, 13, 3, torch_plain(wedlm_torch), every_key),
    "open_dcoder": (
        open_dcoder_fixture.build_converted,
        13,
        3,
        torch_plain(open_dcoder_torch),
        every_key,
    ),
    **{
        name: (
            builder,
            11,
            5,
            reference_logits(ref),
            ckpt_reading(reference_logits(ref, causal=True)),
        )
        for name, builder, ref in (
            ("llada", LLADA_CHECKPOINTS["llada"], llada_torch),
            ("llada_moe", LLADA_CHECKPOINTS["llada_moe"], llada_torch),
            ("dream", dream_fixture.build, dream_torch),
            ("coda", coda_fixture.build, coda_torch),
            ("rnd1", rnd1_fixture.build, rnd1_sampling),
            ("a2d_qwen3", a2d_fixture.build, dllm_a2d),
            ("a2d_qwen2", a2d_qwen2_fixture.build, dllm_a2d),
        )
    },
    # Across a block boundary (blocks of 32): block-causal, so the first block is far from every key.
    "fast_dllm_v2": (
        fast_dllm_fixture.build,
        40,
        9,
        fast_dllm_v2_forward,
        lambda ckpt, model, x: every_key(ckpt, model, x)[:, :32],
    ),
    # Across block boundaries (blocks of 4): every key, not the block-causal decoding mask.
    **{
        name: (
            builder,
            10,
            7,
            reference_logits(sdar_torch, block_length=SDAR_BLOCK, layout="full"),
            lambda ckpt, model, x: sdar_torch.reference_logits(ckpt, x, SDAR_BLOCK),
        )
        for name, builder in sdar_fixture.CHECKPOINTS.items()
    },
    # Two blocks of 32: every key, not the block-causal mask. DMax is llada2_moe's model under its
    # own decoder: the same plain call.
    **{
        name: (
            builder,
            40,
            11,
            llada2_forward,
            lambda ckpt, model, x: llada2_forward(
                ckpt, x, block_causal_mask(40, llada2_fixture.BLOCK_LENGTH)
            ),
        )
        for name, builder in (
            ("llada2_moe", llada2_fixture.build),
            ("dmax", dmax_fixture.build_converted),
        )
    },
    "nemotron": (
        nemotron_fixture.build,
        20,
        13,
        nemotron_forward,
        lambda ckpt, model, x: nemotron_forward(ckpt, x, causal=True),
    ),
    # Blocks of 4.
    "bd3lm": (bd3lm_fixture.build, 10, 17, bd3lm_forward, every_key),
    "dimple": (dimple_fixture.build, 12, 19, dimple_forward, causal_call),
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_plain_call_is_its_forward(fixture_dir, name):
    builder, length, seed, forward, other = ROWS[name]
    ckpt = build_once(fixture_dir / name, builder)
    model = load_fixture(ckpt)[0]
    x = ids(length, seed)
    got, want = plain(model, x), forward(ckpt, x)
    assert_close(got, want)
    contrast = other(ckpt, model, x)
    assert far(got[:, : contrast.shape[1]], contrast)
    if name in CAUSAL:
        # A shorter row, and a head span, read the same causal forward.
        assert_close(np.array(model(mx.array(x[:, :5]))), want[:, :5])
        assert_close(np.array(model(mx.array(x), head_span=(4, 9))), want[:, 4:9])
