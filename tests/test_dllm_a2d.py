"""dllm's A2D Qwen3 MDLM checkpoints (model_type "a2d-qwen3", dllm-hub/Qwen3-0.6B-diffusion-mdlm-v0.1):
the forward against transformers' Qwen3 under A2D's padding-only mask, decoding against a
transcription of dllm's MDLMSampler (tests/reference/dllm_a2d.py), its schedule, the recipe, plain
`mlx_lm convert` / `mlx_lm.load`, batches, sharding and serve."""

import json
import math
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.dllm import ENDOFTEXT, IM_END, MASK, build
from helpers import batch_equal_to_single_runs, checkpoint_fixtures, decoded, load_fixture
from helpers import random_prompt as prompt
from mlx_dllm_models import SettingsError, batch_generate_diffusion
from mlx_dllm_models.decoding.dllm import dllm_schedule, linear_alpha_quotas
from mlx_dllm_models.decoding.samplers import COMMIT_RULES
from mlx_dllm_models.engine import join_policy, make_decoder, select_backend
from mlx_dllm_models.models import a2d_qwen3
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import resolve_settings
from mlx_dllm_models.settings_fields import ResolvedSettings
from mlx_dllm_models.spec import BIDIRECTIONAL, BLOCK_CAUSAL, for_settings
from reference.dllm_a2d import (
    bd3lm_sample,
    get_num_transfer_tokens,
    mdlm_sample,
    reference_forward,
)

DATA = Path(__file__).parent / "data" / "dllm-hub__Qwen3-0.6B-diffusion-mdlm-v0.1"


ckpt, loaded = checkpoint_fixtures("a2d_qwen3", build)


# ------------------------------------------------------------------------------------ forward


def test_head_is_tied_as_qwen3_0_6b(ckpt):
    model, _ = load_fixture(ckpt)
    assert model.args.tie_word_embeddings and not hasattr(model, "lm_head")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    from safetensors.numpy import load_file

    weights = {k: mx.array(v) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    args = a2d_qwen3.ModelArgs.from_dict(cfg)
    with pytest.raises(ValueError, match="no lm_head.weight"):
        a2d_qwen3.Model(args).sanitize(weights)


def test_spec_and_defaults_are_the_sample_script_recipe(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert (spec.family, spec.attention, spec.logit_shift, spec.confidence) == (
        "a2d",
        BIDIRECTIONAL,
        0,
        "raw",
    )
    # config.json's <|im_end|>, and <|endoftext|> from Qwen3's generation_config.json (as mlx-lm
    # reads it): either ends a row's text.
    assert spec.mask_token_id == MASK and spec.eos_token_ids == (IM_END, ENDOFTEXT)
    # Qwen3's generation_config (temperature 0.6, top_p, top_k) is never read by dllm's sampler.
    assert model.generation_config["temperature"] == 0.6
    s = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    want = dict(sampler="mdlm", block_length=32, steps=32, max_tokens=128, temperature=0.0)
    assert {k: getattr(s, k) for k in want} == want
    assert s.top_p is None and s.top_k is None


def test_bad_settings_and_configs_are_clear_errors(loaded, ckpt):
    model, tok = loaded
    with pytest.raises(SettingsError, match="cfg_scale"):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, cfg_scale=1.0)
    with pytest.raises(SettingsError, match="sampler"):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, sampler="dream")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["mask_token_id"] = 10_000
    with pytest.raises(ValueError, match="mask_token_id"):
        a2d_qwen3.ModelArgs.from_dict(cfg)


# --------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 7, 8, 12, 16, 32, 33, 64])
def test_schedule_equals_dllms_get_num_transfer_tokens(steps):
    masks = list(range(0, 41))
    want = get_num_transfer_tokens(
        torch.arange(41)[None, :] < torch.tensor(masks)[:, None], steps
    ).tolist()
    got = dllm_schedule(mx.array(masks), steps).tolist()
    width = max(len(want[0]), len(got[0]))
    pad = lambda rows: [r + [0] * (width - len(r)) for r in rows]  # noqa: E731
    assert pad(got) == pad(want)
    # Not LLaDA's even split: 10 masks over 4 steps is [2, 3, 2, 3] (round half to even), not
    # [3, 3, 2, 2].
    assert linear_alpha_quotas(10, 4) == [2, 3, 2, 3]
    bd3lm = a2d_qwen3.SAMPLERS["bd3lm"]
    assert COMMIT_RULES["mdlm"].schedule is bd3lm.schedule is dllm_schedule


# --------------------------------------------------------------------------------- decoding


def ours(model, prompts, **kw):
    spec = model.diffusion_spec
    settings = resolve_settings(spec, kw, checkpoint_settings(model, spec))
    decoder = make_decoder(model, settings, eos_token_ids=())
    return decoded(decoder, prompts)


def reference(ckpt, prompts, max_tokens, block, steps_per_block):
    total = steps_per_block * math.ceil(max_tokens / block)  # dllm's steps are total
    seq = mdlm_sample(
        reference_forward(ckpt), prompts, max_tokens, block, total, mask_id=MASK, eos_id=IM_END
    )
    assert not (seq == MASK).any()
    return [seq[i, len(p) : len(p) + max_tokens].tolist() for i, p in enumerate(prompts)]


# (prompt length, seed, max_tokens, block_length, steps per block)
CASES = [
    (6, 0, 16, 8, 8),  # one token a step
    (3, 1, 12, 4, 3),  # three blocks, [1, 1, 2]-type quotas
    (9, 2, 20, 8, 3),  # a short last block (4 masks over 3 steps)
    (5, 3, 10, 10, 4),  # one block, 10 masks over 4 steps: [2, 3, 2, 3]
    (4, 4, 8, 8, 20),  # more steps than masks: zero steps dropped
]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_the_mdlm_sampler(loaded, ckpt, case):
    n, seed, max_tokens, block, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    want = reference(ckpt, [p], max_tokens, block, steps)[0]
    got, nfe = ours(model, [p], max_tokens=max_tokens, block_length=block, steps=steps)
    assert got[0] == want
    # One forward per non-zero quota, as the reference's effective steps.
    blocks = [min(block, max_tokens - b) for b in range(0, max_tokens, block)]
    assert nfe == sum(len(linear_alpha_quotas(m, steps)) for m in blocks)


@pytest.mark.slow
def test_the_recipe_matches_the_sampler(loaded, ckpt):
    """The defaults (128 tokens in blocks of 32, 32 steps a block, greedy) end to end."""
    model, _ = loaded
    p = prompt(7, 5)
    got, nfe = ours(model, [p])
    assert got[0] == reference(ckpt, [p], 128, 32, 32)[0] and nfe == 128


class _Draws:
    """One table of uniform draws for both sides: the engine's k-th draw (over its block's
    columns) is table[k]; the reference's k-th forward reads it at the same columns (its other
    columns are never committed)."""

    def __init__(self, n, width, vocab, seed):
        rng = np.random.default_rng(seed)
        self.table = np.clip(rng.random((n, 1, width, vocab)), 1e-20, 1.0).astype(np.float32)
        self.i = 0

    def ours(self, low=0.0, high=1.0, shape=None, key=None, **_):
        assert tuple(shape)[1:] == self.table.shape[2:], shape
        self.i += 1
        return mx.array(self.table[self.i - 1])

    def reference(self, start, block):
        def uniform(k, b, shape):
            u = torch.full(tuple(shape), 0.5, dtype=torch.float32)
            lo = start + b * block
            u[:, lo : lo + block] = torch.from_numpy(self.table[k])
            return u

        return uniform


def test_sampled_tokens_match_the_sampler_with_the_same_draws(loaded, ckpt, monkeypatch):
    """Temperature 0.7 (the chat examples' value): the Gumbel-max draw over the same uniforms
    (add_gumbel_noise's float64 form on the reference side) commits the same tokens."""
    model, _ = loaded
    p, max_tokens, block, steps = prompt(5, 21), 12, 4, 4
    draws = _Draws(12, block, model.args.vocab_size, seed=7)
    want = mdlm_sample(
        reference_forward(ckpt),
        [p],
        max_tokens,
        block,
        steps * 3,
        mask_id=MASK,
        eos_id=IM_END,
        temperature=0.7,
        uniform=draws.reference(len(p), block),
    )[0, len(p) :].tolist()
    monkeypatch.setattr(mx.random, "uniform", draws.ours)
    kw = dict(max_tokens=max_tokens, block_length=block, steps=steps, temperature=0.7)
    got, nfe = ours(model, [p], **kw)
    assert got[0] == want and draws.i == nfe == 12
    monkeypatch.undo()
    assert ours(model, [p], **{**kw, "temperature": 0.0})[0][0] != want  # the draws matter


@pytest.mark.slow
def test_batch_rows_of_different_lengths_equal_single_runs_and_the_reference(loaded, ckpt):
    model, tok = loaded
    prompts = [prompt(9, 10), prompt(3, 11), prompt(14, 12)]
    kw = dict(max_tokens=12, block_length=4, steps=3)
    batch_equal_to_single_runs(model, tok, prompts, **kw)
    # The reference batched (right-padded with EOS, its attention mask hiding the padding).
    got, _ = ours(model, prompts, **kw)
    assert got == reference(ckpt, prompts, 12, 4, 3)


# ------------------------------------------------------------------- mlx-lm, sharding, serve


# ---------------------------------------------------------------------- the published config


def test_published_config_builds_the_full_model_lazily():
    from mlx.utils import tree_flatten

    cfg = json.loads((DATA / "config.json").read_text())
    args = a2d_qwen3.ModelArgs.from_dict(cfg)
    model = a2d_qwen3.Model(args)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 5.8e8 < count < 6.1e8  # Qwen3-0.6B with its tied head (5.96e8)
    spec = model.diffusion_spec
    assert (spec.mask_token_id, spec.eos_token_ids, spec.max_position_embeddings) == (
        151669,
        (151645,),
        40960,
    )
    assert (args.head_dim, args.num_key_value_heads, args.tie_word_embeddings) == (128, 8, True)


# ------------------------------------------------------------------------ BD3LM (block diffusion)


def bd3lm_reference(ckpt, prompts, max_tokens, block, steps_per_block):
    total = steps_per_block * math.ceil(max_tokens / block)
    seq, padded = bd3lm_sample(
        ckpt, prompts, max_tokens, block, total, mask_id=MASK, pad_id=ENDOFTEXT, eos_id=IM_END
    )
    assert not (seq == MASK).any()
    return [seq[i, padded:].tolist() for i in range(len(prompts))]


# (prompt length, seed, max_tokens, block_length, steps per block)
BD3LM_CASES = [
    (6, 0, 16, 8, 8),  # the prompt's first block holds 6 tokens
    (8, 1, 12, 4, 3),  # a prompt of whole blocks
    (9, 2, 20, 8, 3),  # a short last block (4 masks), 9 = 8 + 1
    (3, 3, 10, 10, 4),  # one block, [2, 3, 2, 3]
    (13, 4, 8, 4, 20),  # more steps than masks
]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["auto", "none"])
@pytest.mark.parametrize("case", BD3LM_CASES)
def test_bd3lm_greedy_tokens_match_the_block_sampler(loaded, ckpt, case, cache):
    n, seed, max_tokens, block, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    want = bd3lm_reference(ckpt, [p], max_tokens, block, steps)[0]
    kw = dict(max_tokens=max_tokens, block_length=block, steps=steps, cache=cache)
    got, nfe = ours(model, [p], sampler="bd3lm", **kw)
    # The reference stops after a block holding EOS; the tokens before are the same.
    assert got[0][: len(want)] == want and len(want) >= min(block, max_tokens)
    # MDLM's bidirectional reading of the same checkpoint gives other tokens.
    assert ours(model, [p], sampler="mdlm", **kw)[0][0] != got[0]


def test_bd3lm_runs_on_the_exact_prefix_cache(loaded):
    model, _ = loaded
    spec = for_settings(model.diffusion_spec, ResolvedSettings.from_dict({"sampler": "bd3lm"}))
    assert (spec.attention, spec.blocks_end_at_prompt) == (BLOCK_CAUSAL, True)
    assert model.diffusion_spec.attention == BIDIRECTIONAL  # the model's own spec is MDLM's
    assert (
        select_backend(
            model.diffusion_spec, ResolvedSettings.from_dict({"sampler": "bd3lm"})
        ).__name__
        == "PrefixCache"
    )
    assert (
        select_backend(
            model.diffusion_spec, ResolvedSettings.from_dict({"sampler": "mdlm"})
        ).__name__
        == "FullRecompute"
    )
    # The server joins rows at block boundaries only where the restart is exact: a short last
    # block would see a longer row's masks.
    for max_tokens, joins in ((8, True), (10, False)):
        kw = {"sampler": "bd3lm", "max_tokens": max_tokens, "block_length": 4}
        s = resolve_settings(model.diffusion_spec, kw, {})
        assert join_policy(model.diffusion_spec, s).joins is joins
    s = resolve_settings(model.diffusion_spec, {"max_tokens": 10, "block_length": 4}, {})
    assert join_policy(model.diffusion_spec, s).joins  # MDLM: full recompute, always exact


def test_bd3lm_refuses_infilling_which_mdlm_takes(loaded):
    model, tok = loaded
    with pytest.raises(SettingsError, match="block_causal attention cannot see a suffix"):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, suffix=[42], sampler="bd3lm")
    with pytest.raises(SettingsError, match="infilling"):
        batch_generate_diffusion(model, tok, [[40, MASK, 41]], max_tokens=4, sampler="bd3lm")
    out = batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, suffix=[42])
    assert len(out.tokens[0]) > 0


def test_bd3lm_blocks_end_at_the_prompt(loaded, ckpt):
    """Blocks counted from position 0 (SDAR's alignment) give other tokens: the layout matters."""
    model, _ = loaded
    p = prompt(6, 0)
    want = bd3lm_reference(ckpt, [p], 16, 8, 8)[0]
    sdar = load_fixture(ckpt)[0]
    sdar.diffusion_spec = replace(
        sdar.diffusion_spec, sampler_spec={"bd3lm": {"attention": BLOCK_CAUSAL}}
    )
    got, _ = ours(sdar, [p], sampler="bd3lm", max_tokens=16, block_length=8, steps=8)
    assert got[0][: len(want)] != want


def test_bd3lm_batch_rows_equal_single_runs_and_the_reference(loaded, ckpt):
    model, tok = loaded
    prompts = [prompt(9, 10), prompt(3, 11), prompt(14, 12)]
    kw = dict(sampler="bd3lm", max_tokens=12, block_length=4, steps=3)
    batch_equal_to_single_runs(model, tok, prompts, **kw)
    got, _ = ours(model, prompts, **kw)
    for row, ref in zip(got, bd3lm_reference(ckpt, prompts, 12, 4, 3)):
        assert row[: len(ref)] == ref[: len(row)]
