"""Block-diffusion decoding (SDAR, SDAR-MoE, LLaDA2.x) on the engine: the exact prefix KV cache
against full recompute under the block-causal mask (tokens, forwards, logits under left padding,
batch rows, the commit folded into the next block's forward, chunked prefill), the cache's in-place
writes, and the cache modes a block-causal layout takes or refuses."""

import mlx.core as mx
import numpy as np
import pytest

from block_checks import family_fixture, run, tokens
from helpers import spy_forwards
from mlx_dllm_models.cache import PrefixKVCache
from mlx_dllm_models.engine import (
    BlockEvent,
    FullRecompute,
    Layout,
    select_backend,
)
from mlx_dllm_models.engine.block_cache import PrefixCache
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.settings_fields import ResolvedSettings

family = family_fixture()

# Prompt lengths per family: block-aligned and not, for the trained block (4 / 32) and a smaller one.
PROMPT_LENGTHS = {"sdar": (8, 7, 13), "sdar_moe": (8, 7, 13), "llada2_moe": (32, 7, 45)}

CACHE_CASES = [
    ("sdar", dict(max_tokens=16)),  # the family defaults: threshold 0.9, block 4, 4 steps
    ("sdar", dict(max_tokens=13, sampler="quota", steps=2)),
    ("sdar", dict(max_tokens=12, sampler="sequential", block_length=8, steps=4)),
    ("sdar", dict(max_tokens=16, sampler="entropy", entropy_bound=0.5)),
    ("sdar", dict(max_tokens=16, temperature=1.0, top_p=0.9, seed=5)),
    ("sdar_moe", dict(max_tokens=16)),
    ("sdar_moe", dict(max_tokens=10, sampler="factor", factor=0.5, block_length=8, steps=8)),
    ("llada2_moe", dict(max_tokens=40)),  # threshold 0.95, block 32
    ("llada2_moe", dict(max_tokens=40, sampler="quota", steps=8)),
    ("llada2_moe", dict(max_tokens=24, block_length=8, steps=8, threshold=0.7)),
    ("llada2_moe", dict(max_tokens=40, threshold=0.7, editing_threshold=0.6, max_post_steps=4)),
    ("llada2_moe", dict(max_tokens=30, block_length=16, steps=16, editing_threshold=0.8)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", CACHE_CASES)
def test_prefix_cache_is_token_identical_to_full_recompute(family, name, kw):
    _, model, tok = family(name)
    for n in PROMPT_LENGTHS[name]:
        prompt = tokens(n, seed=n)
        full, full_reasons, full_dec = run(model, tok, [prompt], cache="none", **kw)
        cached, reasons, dec = run(model, tok, [prompt], **kw)
        assert isinstance(dec.backend, PrefixCache) and isinstance(full_dec.backend, FullRecompute)
        assert cached == full and reasons == full_reasons
        # The same denoising forwards, plus the prompt's prefill, and no commit forward.
        assert dec.nfe == full_dec.nfe + dec.backend.prefill_forwards
        assert dec.backend.prefill_forwards == (1 if n >= dec.s.block_length else 0)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("sdar", dict(max_tokens=14)),
        ("sdar_moe", dict(max_tokens=9, sampler="quota", block_length=8, steps=4)),
        ("llada2_moe", dict(max_tokens=64, threshold=0.7)),
        ("llada2_moe", dict(max_tokens=64, threshold=0.7, editing_threshold=0.7, max_post_steps=4)),
    ],
)
def test_batch_of_prompts_of_different_lengths_equals_one_by_one(family, name, kw):
    _, model, tok = family(name)
    prompts = [tokens(n, seed=n) for n in (7, 3, 40, 11)]
    batch, batch_reasons, dec = run(model, tok, prompts, **kw)
    for prompt, got, reason in zip(prompts, batch, batch_reasons):
        (alone,), (alone_reason,), _ = run(model, tok, [prompt], **kw)
        assert got == alone and reason == alone_reason
        (full,), _, _ = run(model, tok, [prompt], cache="none", **kw)
        assert got == full


def test_the_batch_case_drops_a_row_that_stopped_early(family):
    """The premise of the LLaDA2 cases above: rows meet an EOS, leave the batch, and the cache
    (its rows selected) carries on with the others."""
    _, model, tok = family("llada2_moe")
    kw = dict(max_tokens=64, threshold=0.7, editing_threshold=0.7, max_post_steps=4)
    _, ids, dec = stream_events(model, tok, [tokens(n, seed=n) for n in (7, 3, 40, 11)], **kw)
    rows = [event.rows for event in dec.run(ids) if isinstance(event, BlockEvent)]
    assert len(rows[-1]) < len(rows[0]) and isinstance(dec.backend, PrefixCache)


def test_cache_logits_match_the_full_window(family):
    """Numerics under left padding: the open block's logits from [cached prefix ; block] and from
    the whole window under the block-causal mask, for the first block and the folded second."""
    _, model, _ = family("sdar")
    spec = model.diffusion_spec
    settings = ResolvedSettings.from_dict(dict(block_length=4, max_tokens=12))
    prompts = [tokens(6, 1), tokens(13, 2)]
    layout = Layout(prompts, 12, 4, True, spec.mask_token_id)
    x = layout.tokens
    x = mx.where(
        x == spec.mask_token_id, mx.array(np.random.default_rng(0).integers(0, 256, x.shape)), x
    )
    full, cached = (
        FullRecompute(model, spec, layout, settings),
        PrefixCache(model, spec, layout, settings),
    )
    cached.prefill(x)
    for start, stop in layout.blocks()[:2]:
        ref = full.block_logits(x, start, stop)
        got = cached.block_logits(x, start, stop)
        err = mx.abs(got - ref).max().item()
        assert err <= 1e-5 * mx.abs(ref).max().item(), f"max abs error {err:.3g}"
    assert cached.commits_folded == 1 and cached.cache.committed == layout.blocks()[1][0]


def test_commit_is_folded_into_the_next_blocks_first_forward(family):
    path, model, tok = family("sdar")
    seen = []

    def record(inputs, cache, mask, head_span):
        seen.append((inputs.shape[1], cache.start, cache.committed, head_span))

    with spy_forwards(model, record):
        prompt = tokens(10, 3)  # two whole prompt blocks, a tail of 2 in the first open block
        out, _, dec = run(model, tok, [prompt], max_tokens=14, sampler="quota")
    backend = dec.backend
    assert seen[0] == (8, 0, 0, (7, 8))  # prefill: the whole blocks, the LM head over one row
    starts = [start for _, start, _, _ in seen[1:]]
    # The first block's forwards start at its aligned column 8 (the tail is re-encoded with it);
    # each later block's first forward starts one block earlier: the finished block rides along.
    n_blocks = 4  # columns 8..24: [10, 12) [12, 16) [16, 20) [20, 24)
    assert backend.commits_saved == n_blocks and backend.commits_folded == n_blocks - 1
    assert sorted(set(starts)) == [8, 12, 16, 20]
    folded = [(n, s, c) for n, s, c, _ in seen[1:] if n == 8]
    assert folded == [(8, 8, 8), (8, 12, 12), (8, 16, 16)]
    assert all(n in (4, 8) for n, _, _, _ in seen[1:])
    # quota over block_length 4 in 4 steps: one token a step, 14 tokens, no separate commit forward.
    assert len(out[0]) == 14 and dec.nfe == 1 + 14


def test_long_prompts_are_prefilled_in_chunks_of_whole_blocks(family, monkeypatch):
    from mlx_dllm_models.engine import block_cache

    _, model, tok = family("sdar")
    monkeypatch.setattr(block_cache, "PREFILL_TOKENS", 9)  # two blocks of 4 a chunk
    prompt = tokens(21, seed=4)  # whole blocks over columns 0..20: chunks 0..8, 8..16, 16..20
    full, _, _ = run(model, tok, [prompt], max_tokens=11, cache="none")
    cached, _, dec = run(model, tok, [prompt], max_tokens=11)
    assert cached == full and dec.backend.prefill_forwards == 3


def test_block_kv_cache_writes_in_place():
    cache = PrefixKVCache(num_layers=1, width=12, left_padding=[0, 4])
    layer = cache[0]
    rng = np.random.default_rng(0)
    kv = lambda n: mx.array(rng.standard_normal((2, 2, n, 8)).astype(np.float32))  # noqa: E731
    prefix = kv(8)
    cache.at(0)
    layer.update_and_fetch(prefix, prefix)
    assert layer.keys.shape == (2, 2, 12, 8)  # the whole window, allocated once
    cache.commit(8)
    for _ in range(2):  # two denoising steps of the open block: rewritten in place
        block = kv(4)
        k, v = cache.at(8)[0].update_and_fetch(block, block)
        assert k.shape[2] == 12 and cache.committed == 8
        assert mx.array_equal(k[..., :8, :], prefix) and mx.array_equal(k[..., 8:, :], block)
    assert cache.offset.tolist() == [8, 4]  # RoPE positions: column minus each row's padding
    with pytest.raises(ValueError, match="without final K/V"):
        cache.at(10)


def test_cache_modes_select_backends(family):
    _, model, tok = family("sdar")
    spec = model.diffusion_spec
    assert select_backend(spec, ResolvedSettings.from_dict({"cache": "auto"})) is PrefixCache
    assert select_backend(spec, ResolvedSettings.from_dict({"cache": "prefix"})) is PrefixCache
    assert select_backend(spec, ResolvedSettings.from_dict({"cache": "none"})) is FullRecompute


@pytest.mark.parametrize("name", ["sdar", "llada2_moe"])
def test_a_cache_the_layout_cannot_make_exact_is_refused(family, name):
    _, model, tok = family(name)
    with pytest.raises(
        SettingsError, match=r"cache='dual' is not available .*block_causal.*auto, none, prefix"
    ):
        run(model, tok, [[1, 2, 3]], max_tokens=4, cache="dual")
