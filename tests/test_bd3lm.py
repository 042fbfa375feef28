"""BD3-LM (kuleshov-group/bd3lm-owt-block_size4 / 8 / 16, model_type "bd3lm") against the torch
transcription of kuleshov-group/bd3lms (tests/reference/bd3lm_torch.py): the DiT's logits under
the block-causal mask and block by block over a KV cache, the first-hitting semi-AR sampler with
its nucleus (the same draws replayed on both sides, and greedy at a tiny nucleus), batch rows,
mlx-lm's convert and load, and the errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_lm.models.cache import KVCache
from safetensors.numpy import load_file

from fixtures.bd3lm import BLOCK, ENDOFTEXT, MASK, VOCAB, build
from helpers import ROOT, RecordedDraws, assert_close, checkpoint_fixtures, far, load_fixture
from mlx_dllm_models import (
    CheckpointError,
    SettingsError,
    batch_generate_diffusion,
    generate_diffusion,
    load,
)
from mlx_dllm_models.decoding import llada as llada_rules
from mlx_dllm_models.decoding import stats as stats_module
from mlx_dllm_models.decoding.bd3lm import top_p_within
from mlx_dllm_models.masks import block_causal_mask, every_key
from mlx_dllm_models.models import bd3lm
from reference.bd3lm_torch import BD3LMReference

ckpt, loaded = checkpoint_fixtures("bd3lm", build, loader=load_fixture)


@pytest.fixture(scope="module")
def ref(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    return BD3LMReference(load_file(str(ckpt / "model.safetensors")), cfg)


def ids(n, seed):
    return np.random.default_rng(seed).integers(0, ENDOFTEXT, n).tolist()


# ----------------------------------------------------------------------------------- forward


@pytest.mark.slow
def test_logits_match_the_reference_under_the_block_causal_mask(loaded, ref):
    model, _ = loaded
    x = [[ENDOFTEXT] + ids(13, 1) + [MASK] * 6]
    got = np.array(model(mx.array(x), mask=block_causal_mask(20, BLOCK)))
    want = ref.forward(torch.tensor(x)).numpy()
    assert_close(got, want)
    # The mask matters: bidirectional attention gives other logits.
    assert far(np.array(model(mx.array(x), mask=every_key(20))), want)
    # The plain call is upstream's sampling forward: the block-causal one.
    assert_close(np.array(model(mx.array(x))), want)


def test_logits_block_by_block_over_a_kv_cache_match(loaded, ref):
    model, _ = loaded
    x = torch.tensor([[ENDOFTEXT] + ids(11, 2) + [MASK] * 4])
    full = ref.forward(x).numpy()
    cache = [KVCache() for _ in model.layers]
    ref.reset_kv_cache(1)
    for b in range(x.shape[1] // BLOCK):
        block = x[:, b * BLOCK : (b + 1) * BLOCK]
        got = np.array(model(mx.array(block.numpy()), cache=cache))
        want = ref.forward(block, store_kv=True).numpy()
        assert_close(got, want)  # the reference's own cached path (upstream's sampling path)
        assert_close(got, full[:, b * BLOCK : (b + 1) * BLOCK])
    ref.kv = None


def test_nucleus_keeps_the_tokens_within_p(ref):
    logits = torch.randn(3, 5, 40) * 3
    for p in (0.3, 0.9, 0.999):
        kept = np.isfinite(np.array(top_p_within(mx.array(logits.numpy()), p)))
        want = BD3LMReference.nucleus(torch.softmax(logits.double(), -1), p).numpy() > 0
        assert (kept == want).all()
    # HF's top-p keeps the token that crosses p as well: this one does not.
    two = mx.log(mx.array([[0.5, 0.3, 0.2]]))
    assert np.isfinite(np.array(top_p_within(two, 0.85))).tolist() == [[True, True, False]]


# ----------------------------------------------------------------------------------- sampler


def _until_eos(tokens):
    return tokens[: tokens.index(ENDOFTEXT)] if ENDOFTEXT in tokens else tokens


# (prompt after the BOS, top_p, cache): the recipe's nucleus from the BOS alone and after a
# prompt that crosses a block boundary, over the prefix cache and without one; the tiny nucleus.
SAMPLER_CASES = [
    ([], 0.9, "prefix"),
    (ids(6, 3), 0.9, "prefix"),
    (ids(6, 3), 0.9, "none"),
    ([], 1e-6, "none"),
]


@pytest.mark.parametrize("prompt_ids,top_p,cache", SAMPLER_CASES)
def test_sampler_matches_the_reference_with_the_same_draws(
    loaded, ref, monkeypatch, prompt_ids, top_p, cache
):
    """_semi_ar_sampler (first_hitting, nucleus) from the BOS (upstream's unconditional start) or
    after a prompt that crosses a block boundary; at top_p 1e-6 the nucleus is the argmax."""
    model, tok = loaded
    draws = RecordedDraws(seed=len(prompt_ids) + int(top_p * 10))
    monkeypatch.setattr(stats_module, "uniform", draws.ours_tokens)
    monkeypatch.setattr(llada_rules, "random_confidence", draws.ours_positions)
    max_tokens = 18
    out = batch_generate_diffusion(
        model, tok, [prompt_ids], max_tokens=max_tokens, top_p=top_p, cache=cache, seed=0
    )
    got = out.tokens[0]
    seq, nfe = ref.sample(
        [[ENDOFTEXT] + prompt_ids],
        max_tokens,
        top_p,
        draws.ref_tokens,
        draws.ref_position,
        kv_cache=cache == "prefix",
    )
    want = seq[0, 1 + len(prompt_ids) :].tolist()
    assert got == _until_eos(want)[:max_tokens] and len(got) >= 6
    assert nfe == len(want)  # first hitting: one token a step
    assert draws.made > 0


def test_the_draws_matter_and_greedy_is_the_tiny_nucleus(loaded):
    model, tok = loaded
    kw = dict(max_tokens=16)
    sampled = [generate_diffusion(model, tok, "", seed=s, **kw) for s in (3, 4)]
    tiny = generate_diffusion(model, tok, "", top_p=1e-6, seed=3, **kw)
    assert tiny == generate_diffusion(model, tok, "", temperature=0.0, seed=3, **kw)
    # At the recipe's nucleus 0.9 the token draws matter (the positions' draws are the same).
    assert sampled[0] != tiny and sampled[0] != sampled[1]


def test_empty_and_bos_prompts_are_unconditional_generation(loaded):
    model, tok = loaded
    kw = dict(max_tokens=12, seed=5)
    empty = batch_generate_diffusion(model, tok, [""], **kw).tokens[0]
    assert empty == batch_generate_diffusion(model, tok, [[ENDOFTEXT]], **kw).tokens[0]
    assert empty == batch_generate_diffusion(model, tok, [[]], **kw).tokens[0]
    assert empty == batch_generate_diffusion(model, tok, ["<|endoftext|>"], **kw).tokens[0]
    # A text prompt is read after the BOS.
    text = batch_generate_diffusion(model, tok, ["hey"], **kw).tokens[0]
    assert (
        text == batch_generate_diffusion(model, tok, [[ENDOFTEXT, 104, 101, 121]], **kw).tokens[0]
    )


def test_batch_rows_equal_single_runs(loaded):
    model, tok = loaded
    prompts = ["", "hello there", "The cat"]
    kw = dict(max_tokens=14)
    batch = batch_generate_diffusion(model, tok, prompts, **kw).tokens
    for p, got in zip(prompts, batch):
        assert got == batch_generate_diffusion(model, tok, [p], **kw).tokens[0]
    assert len(set(map(tuple, batch))) == 3


def test_spec_is_the_published_recipe():
    cfg = json.loads(
        (ROOT / "tests/data/kuleshov-group__bd3lm-owt-block_size4/config.json").read_text()
    )
    model = bd3lm.Model(bd3lm.ModelArgs.from_dict(cfg))
    spec = model.diffusion_spec
    assert (spec.mask_token_id, spec.eos_token_ids, spec.prompt_prefix) == (
        50257,
        (50256,),
        (50256,),
    )
    assert spec.defaults["block_length"] == 4 and spec.max_position_embeddings == 1024
    assert (spec.defaults["sampler"], spec.defaults["top_p"], spec.defaults["temperature"]) == (
        "random",
        0.9,
        1.0,
    )
    from mlx.utils import tree_flatten

    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 1.6e8 < count < 1.7e8  # 12 x 768 DiT, untied 50258-row embedding and head


# ------------------------------------------------------------------------- mlx-lm and errors


def test_bad_inputs_are_clear_errors(loaded, ckpt, tmp_path):
    model, tok = loaded
    with pytest.raises(SettingsError, match="exceeds the model's context of 64"):
        generate_diffusion(model, tok, "hi", max_tokens=64)
    with pytest.raises(SettingsError, match="outside the vocabulary"):
        generate_diffusion(model, tok, [ENDOFTEXT, VOCAB], max_tokens=4)
    bad = tmp_path / "timed"
    build(bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, time_conditioning=True)))
    with pytest.raises(CheckpointError, match="time_conditioning=true"):
        load(str(bad))
