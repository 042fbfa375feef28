"""CoDA (Salesforce/CoDA-v0-Instruct): the forward against transformers' Qwen3 read bidirectionally,
decoding against a transcription of CoDA's generation_utils.py (tests/reference/coda_torch.py), the
published config and recipe, plain `mlx_lm convert` / `mlx_lm.load`, batches, sharding and serve."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.coda import MASK, build
from helpers import batch_equal_to_single_runs, checkpoint_fixtures, decoded
from helpers import random_prompt as prompt
from mlx_dllm_models import SettingsError, batch_generate_diffusion
from mlx_dllm_models.decoding import dream as dream_rules
from mlx_dllm_models.engine import make_decoder
from mlx_dllm_models.models import coda
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import family_settings, resolve_settings
from reference.coda_torch import coda_generate, reference_forward

DATA = Path(__file__).parent / "data" / "Salesforce__CoDA-v0-Instruct"


ckpt, loaded = checkpoint_fixtures("coda", build)


# ------------------------------------------------------------------------------------ forward


def test_spec_and_defaults_are_the_published_recipe(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert set(family_settings("coda")) == {"alg", "alg_temp", "eps"}
    # The published generation_config.json (alg "original", alg_temp 0.2, diffusion_steps 10)
    # is what the reference never reads; the deployment recipe is the default.
    assert model.generation_config["alg"] == "original"
    s = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    want = dict(sampler="dream", alg="entropy", alg_temp=0.1, eps=1e-3, temperature=0.0)
    assert {k: getattr(s, k) for k in want} == want
    assert (s.max_tokens, s.steps, s.block_length, s.top_p, s.top_k) == (
        256,
        128,
        256,
        None,
        None,
    )
    # The shared samplers keep one step per position of their blocks.
    q = resolve_settings(spec, {"sampler": "quota"}, {})
    assert (q.block_length, q.steps) == (32, 32)


def test_head_is_never_tied_and_a_missing_head_is_named(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = True  # CoDAConfig's default: the reference still has its own head
    args = coda.ModelArgs.from_dict(cfg)
    assert args.tie_word_embeddings is False
    from safetensors.numpy import load_file

    weights = {k: mx.array(v) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    del weights["lm_head.weight"]
    with pytest.raises(ValueError, match="no lm_head.weight"):
        coda.Model(args).sanitize(weights)


# --------------------------------------------------------------------------------- decoding


def ours(model, prompts, **kw):
    spec = model.diffusion_spec
    kw = {"temperature": 0.0, **kw}
    settings = resolve_settings(spec, kw, checkpoint_settings(model, spec))
    decoder = make_decoder(model, settings, eos_token_ids=())
    return decoded(decoder, prompts)


def reference(ckpt, p, max_tokens, steps, **kw):
    seq = coda_generate(reference_forward(ckpt), np.array([p]), max_tokens, steps, **kw)
    assert not (seq == MASK).any()
    return seq[0, len(p) :].tolist()


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("case", [(6, 0, 10, 10), (3, 1, 12, 5), (9, 2, 8, 20)])
def test_greedy_ranked_algorithms_match_the_reference(loaded, ckpt, alg, case):
    n, seed, max_tokens, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    want = reference(ckpt, p, max_tokens, steps, alg=alg, alg_temp=0.0, mask_token_id=MASK)
    got, _ = ours(model, [p], max_tokens=max_tokens, steps=steps, alg=alg, alg_temp=0.0)
    assert got[0] == want


class _Noise:
    """alg_temp's position draws on both sides from one Gumbel table: the engine's `_gumbel`
    returns G[i] at its i-th drawing step; the reference takes the top n of
    log(probs) + G[i] (over prompt + canvas; the prompt's probabilities are 0), which is a draw
    of n positions without replacement from `probs`, the distribution torch.multinomial draws."""

    def __init__(self, steps, n_prompt, max_tokens, seed):
        u = np.random.default_rng(seed).random((steps, max_tokens))
        self.g = (-np.log(-np.log(u))).astype(np.float32)
        self.n_prompt, self.i, self.j = n_prompt, 0, 0

    def ours(self, key, shape):
        assert shape == (1, self.g.shape[1])
        self.i += 1
        return mx.array(self.g[self.i - 1][None])

    def reference(self, probs, n):
        g = np.concatenate([np.zeros(self.n_prompt, np.float32), self.g[self.j]])
        self.j += 1
        return torch.topk(torch.log(probs) + torch.from_numpy(g)[None], n).indices


@pytest.mark.slow
@pytest.mark.parametrize("case", [(7, 3, 256, 128), (5, 4, 24, 12)])
def test_the_recipe_matches_the_reference_with_the_same_draws(loaded, ckpt, monkeypatch, case):
    """The defaults (alg entropy, alg_temp 0.1, 128 steps for 256 tokens, temperature 0) against
    the reference with the same position draws."""
    n, seed, max_tokens, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    noise = _Noise(steps, n, max_tokens, seed=seed + 50)
    seq = coda_generate(
        reference_forward(ckpt),
        np.array([p]),
        max_tokens,
        steps,
        alg="entropy",
        alg_temp=0.1,
        mask_token_id=MASK,
        draw_positions=noise.reference,
    )
    monkeypatch.setattr(dream_rules, "_gumbel", noise.ours)
    got, nfe = ours(model, [p], max_tokens=max_tokens, steps=steps)
    assert got[0] == seq[0, n:].tolist()
    assert noise.i == noise.j == nfe  # one draw per step that commits, on both sides
    # The draws matter: greedy ranking gives other tokens.
    greedy = reference(ckpt, p, max_tokens, steps, alg="entropy", mask_token_id=MASK)
    assert greedy != got[0]


def test_batch_rows_of_different_lengths_equal_single_runs(loaded):
    model, tok = loaded
    prompts = [prompt(9, 10), prompt(3, 11), prompt(14, 12)]
    # One run (similar lengths), left-padded, at the recipe's alg_temp 0.1: each row draws its
    # positions from a stream of its own seed, as it would alone.
    kw = dict(max_tokens=12, steps=6)
    batch = batch_equal_to_single_runs(model, tok, prompts, **kw)
    # The draws matter: greedy ranking, or another seed, gives other tokens in some row.
    greedy = batch_generate_diffusion(model, tok, prompts, alg_temp=0.0, **kw).tokens
    other = batch_generate_diffusion(model, tok, prompts, seed=7, **kw).tokens
    assert greedy != batch.tokens and other != batch.tokens


def test_bad_settings_are_clear_errors(loaded):
    model, tok = loaded
    with pytest.raises(SettingsError, match="unknown alg 'original'"):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, alg="original")
    with pytest.raises(SettingsError, match="alg_temp only acts with sampler='dream'"):
        batch_generate_diffusion(model, tok, [[40]], max_tokens=4, sampler="quota", alg_temp=0.1)


# ------------------------------------------------------------------- mlx-lm, sharding, serve


# ---------------------------------------------------------------------- the published files


def test_published_config_builds_the_full_model_lazily():
    from mlx.utils import tree_flatten

    cfg = json.loads((DATA / "config.json").read_text())
    args = coda.ModelArgs.from_dict(cfg)
    model = coda.Model(args)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 1.9e9 < count < 2.2e9  # Qwen3-1.7B's body with its own head (2.03e9)
    spec = model.diffusion_spec
    assert (spec.mask_token_id, spec.eos_token_ids, spec.max_position_embeddings) == (
        151669,
        (151645,),
        40960,
    )
    assert (args.head_dim, args.num_key_value_heads, args.rope_theta) == (128, 8, 1000000)
    tokens = json.loads((DATA / "added_tokens.json").read_text())
    assert tokens["<|mask|>"] == spec.mask_token_id and tokens["<|im_end|>"] == 151645
    special = json.loads((DATA / "special_tokens_map.json").read_text())
    assert special["mask_token"]["content"] == "<|mask|>"
