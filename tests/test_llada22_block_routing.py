"""LLaDA2.2's block expert routing: the MLX router against its torch transcription
(tests/reference/llada2_block_routing.py), the model's logits against mlx-vlm's llada2_moe with its
router replaced by that transcription, and block routing under the engine's caches and left padding.

The model here is built from the 2.2 fixture's config with `expert_capacity` set after ModelArgs'
checks (the unrouted model is the same config without it), which is what loading builds."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from block_checks import read_weights
from fixtures import llada2 as llada2_fixture
from helpers import assert_close, checkpoint_fixtures, far
from mlx_dllm_models.generate import batch_generate_diffusion
from mlx_dllm_models.masks import block_causal_mask
from mlx_dllm_models.models import llada2_moe
from reference.llada2_block_routing import block_routing

BLOCK = llada2_fixture.BLOCK_LENGTH


def build_model(path, routed=True):
    cfg = json.loads((path / "config.json").read_text())
    capacity = cfg.pop("expert_capacity")
    args = llada2_moe.ModelArgs.from_dict(cfg)
    if routed:
        args.expert_capacity = capacity
    model = llada2_moe.Model(args)
    model.load_weights(list(model.sanitize(read_weights(path)).items()))
    return model


checkpoint, model = checkpoint_fixtures(
    "llada22", llada2_fixture.build_22, "model", "checkpoint", build_model
)


def reference_route(logits, bias, first, top_k, capacity, scaling):
    """The torch transcription over a (B, L, E) batch whose row b starts at position first[b]."""
    ids, weights = [], []
    for row, start in zip(np.asarray(logits, np.float32), first):
        positions = torch.arange(row.shape[0]) + int(start)
        i, w = block_routing(
            torch.from_numpy(row),
            torch.from_numpy(bias),
            positions,
            top_k,
            capacity,
            BLOCK,
            scaling,
        )
        ids.append(i.numpy())
        weights.append(w.numpy())
    return np.stack(ids), np.stack(weights)


def ordered(ids, weights):
    """Each token's experts in ascending order with their weights: the routers list a token's
    experts in different orders."""
    ids, weights = np.asarray(ids), np.asarray(weights)
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def same_routing(a, b):
    (ia, wa), (ib, wb) = ordered(*a), ordered(*b)
    return np.array_equal(ia, ib) and np.allclose(wa, wb, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "length,first",
    [
        (64, [0, 0]),  # whole blocks
        (75, [0, -32]),  # a partial last block; a row left-padded by one block
        (40, [40, -8]),  # starting inside a block (8 and 24 slots before the input)
    ],
)
def test_router_matches_transcription(length, first):
    rng = np.random.default_rng(length)
    logits = rng.standard_normal((2, length, 8)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(8)).astype(np.float32)
    ids, weights = llada2_moe.block_limited_topk(
        mx.array(logits), mx.array(bias), mx.array(first), 2, 3, BLOCK, 2.5
    )
    ref = reference_route(logits, bias, first, 2, 3, 2.5)
    assert same_routing((ids, weights), ref)
    # The pool matters: the per-token router (every expert allowed) picks otherwise.
    free = reference_route(logits, bias, first, 2, 8, 2.5)
    assert not np.array_equal(ordered(*free)[0], ordered(*ref)[0])


def patched_mlx_vlm(path):
    """mlx-vlm's llada2_moe language model on the checkpoint, each gate routing through the torch
    transcription (positions from 0: the calls here have no cache)."""
    from mlx_vlm.models.llada2_moe import Model
    from mlx_vlm.models.llada2_moe.config import ModelConfig

    cfg = json.loads((path / "config.json").read_text())
    capacity = cfg["expert_capacity"]
    vlm = Model(ModelConfig.from_dict(cfg))
    vlm.load_weights(list(vlm.sanitize(read_weights(path)).items()))

    def route(gate, hidden):
        logits = hidden.astype(mx.float32) @ gate.weight.T.astype(mx.float32)
        bias = np.asarray(gate.expert_bias, np.float32)
        first = [0] * logits.shape[0]
        ids, w = reference_route(
            logits, bias, first, gate.top_k, capacity, gate.routed_scaling_factor
        )
        return mx.array(ids.astype(np.int32)), mx.array(w).astype(hidden.dtype), logits

    gate_class = type(vlm.language_model.model.layers[1].mlp.gate)
    return vlm.language_model, gate_class, route


@pytest.mark.parametrize("length,prompt", [(64, 40), (75, 45)])
def test_logits_match_mlx_vlm_with_transcribed_router(
    model, checkpoint, length, prompt, monkeypatch
):
    reference, gate_class, route = patched_mlx_vlm(checkpoint)
    monkeypatch.setattr(gate_class, "__call__", route)
    ids = np.random.default_rng(length).integers(0, 256, (2, length))
    ids[:, prompt:] = llada2_fixture.MASK
    ids = mx.array(ids)
    mask = block_causal_mask(length, BLOCK)
    ours = model(ids, mask=mask)
    assert_close(ours, reference(ids, mask=mask).logits)
    # Without the block pool (2.1's per-token router) the logits differ.
    assert far(build_model(checkpoint, routed=False)(ids, mask=mask), ours)


def tokenizer(path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(path, tokenizer_config_extra={"trust_remote_code": False})


def test_batch_rows_equal_single_runs_under_both_caches(model, checkpoint):
    """Left padding shifts a row's columns by whole blocks and routing follows positions, so a
    row in a batch decodes as it does alone; the prefix cache's forwards (whole blocks against the
    cached prefix) route as full recompute's (the whole window from position 0) do."""
    tok = tokenizer(checkpoint)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 45)]
    results = []
    for cache in ("prefix", "none"):
        kw = dict(max_tokens=40, threshold=0.7, editing_threshold=None, cache=cache)
        batch = batch_generate_diffusion(model, tok, prompts, **kw).tokens
        assert batch == [batch_generate_diffusion(model, tok, [p], **kw).tokens[0] for p in prompts]
        assert all(len(row) > 0 for row in batch)
        results.append(batch)
    assert results[0] == results[1]


def test_plain_call_is_upstreams_forward_with_block_routing(model, checkpoint, monkeypatch):
    """`model(ids)` with no mask is upstream's forward under transformers' default SDPA (no mask,
    is_causal=False: every key), with 2.2's block routing; not the block-causal decoding mask."""
    reference, gate_class, route = patched_mlx_vlm(checkpoint)
    monkeypatch.setattr(gate_class, "__call__", route)
    ids = mx.array(np.random.default_rng(5).integers(0, 256, (1, 40)))
    ours = model(ids)
    assert_close(ours, reference(ids).logits)
    assert far(ours, model(ids, mask=block_causal_mask(40, BLOCK)))
