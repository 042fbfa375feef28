"""Block-diffusion decoding (SDAR, SDAR-MoE, LLaDA2.x) on the engine: the exact prefix KV cache
against full recompute under the block-causal mask, token parity at temperature 0 with plain
transcriptions of the reference loops (SDAR generate.py; LLaDA2.0 / 2.1 generate), token
editing, the block-length warning and bad input."""

import json
import logging

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures import llada2 as llada2_fixture
from fixtures import sdar as sdar_fixture
from helpers import load_fixture, spy_forwards
from mlx_dllm_models import load as load_checkpoint
from mlx_dllm_models.cache import PrefixKVCache
from mlx_dllm_models.decoding.block import sequential_commit
from mlx_dllm_models.engine import (
    BlockEvent,
    FullRecompute,
    Layout,
    StepContext,
    StepEvent,
    select_backend,
)
from mlx_dllm_models.engine.block_cache import PrefixCache
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.settings_fields import ResolvedSettings
from reference.llada2_generate import llada20_generate, llada21_generate
from reference.sdar_generate import sdar_generate
from reference.sdar_torch import load_reference

BUILDERS = {
    "sdar": sdar_fixture.build_sdar,
    "sdar_moe": sdar_fixture.build_sdar_moe,
    "llada2_moe": llada2_fixture.build,
}


@pytest.fixture(scope="module")
def family(fixture_dir):
    loaded = {}

    def get(name):
        if name not in loaded:
            path = build_once(fixture_dir / name, BUILDERS[name])
            loaded[name] = (path, *load_fixture(path))
        return loaded[name]

    return get


def run(model, tok, prompts, **kw):
    """Tokens and finish reasons of each row, and the decoder (its backend holds the counters)."""
    _, ids, decoder = stream_events(model, tok, prompts, **kw)
    out, reasons = [[] for _ in ids], ["length"] * len(ids)
    for event in decoder.run(ids):
        if isinstance(event, BlockEvent):
            for row, toks, hit in zip(event.rows, event.tokens, event.eos):
                out[row].extend(toks)
                reasons[row] = "stop" if hit else reasons[row]
    return out, reasons, decoder


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


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


def test_sequential_commits_the_leftmost_masks():
    cand = mx.array([[False, True, True, False, True, True], [True, True, True, True, True, True]])
    conf = mx.array(np.linspace(0, 1, 12).reshape(2, 6).astype(np.float32))
    stats = type("S", (), {"confidence": conf})()
    ctx = StepContext(0, 2, mx.array([3, 2]), None, ResolvedSettings.from_dict({}), None)
    got = sequential_commit(stats, cand, ctx)
    assert got.tolist() == [
        [False, True, True, False, True, False],
        [True, True, False, False, False, False],
    ]


# ------------------------------------------------------------------------------ SDAR reference


def transformers_forward(path):
    model = load_reference(str(path))

    def forward(ids, keep):
        n = ids.shape[1]
        additive = torch.zeros(n, n).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]
        with torch.no_grad():
            out = model(
                input_ids=ids,
                attention_mask=additive,
                position_ids=torch.arange(n)[None],
                use_cache=False,
            )
        return out.logits.float()

    return forward


def cut_at_eos(ids, eos):
    ids = [int(t) for t in ids]
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


SDAR_STRATEGIES = {
    "quota": "low_confidence_static",
    "threshold": "low_confidence_dynamic",
    "sequential": "sequential",
    "entropy_bounded": "entropy_bounded",
}


@pytest.mark.parametrize(
    "name,sampler,block_length,steps",
    [
        ("sdar", "quota", 4, 4),
        ("sdar", "threshold", 4, 4),
        ("sdar", "sequential", 4, 4),
        ("sdar", "quota", 4, 2),
        ("sdar", "threshold", 8, 4),
        ("sdar", "sequential", 8, 4),
        ("sdar_moe", "threshold", 4, 4),
    ],
)
def test_sdar_matches_block_diffusion_generate(family, name, sampler, block_length, steps):
    _check_sdar_against_reference(family, name, sampler, block_length, steps)


def test_sdar_entropy_bounded_matches_block_diffusion_generate(family):
    """generate.py's default eb_threshold (0.35) and larger budgets that commit several masks a
    step. Prompts that end on a block edge: upstream's sum also covers prompt tokens that share the
    first block, the engine's does not (see decoding.block.entropy_bounded_commit)."""
    forwards = [
        tuple(
            _check_sdar_against_reference(
                family, "sdar", "entropy_bounded", 4, 4, eb_threshold=eb, prompts=(8,)
            )
        )
        for eb in (0.35, 2.0, 6.0)
    ]
    assert len(set(forwards)) == 3, f"the budgets did not change the commits: {forwards}"


def _check_sdar_against_reference(
    family, name, sampler, block_length, steps, eb_threshold=None, prompts=None
):
    """Greedy (the reference's T=0 divides by zero; see the transcription). With several tokens a
    step the reference's top-k may take non-mask positions; the transcription is told to take
    only masks there (topk_over_masks_only), which is what the engine does."""
    path, model, tok = family(name)
    spec = model.diffusion_spec
    eos = set(spec.eos_token_ids)
    forward = transformers_forward(path)
    # Requests that end on a block edge, and mid-block (the reference decodes the whole last
    # block and cuts it; so must the engine).
    cases = ((8, None), (7, None), (11, 32), (13, 18))
    if prompts is not None:
        cases = [(n, gen) for n in prompts for gen in (None, 30)]
    out = []
    for n, gen in cases:
        prompt = tokens(n, seed=n)
        if gen is None:
            gen = -(-(n + 16) // block_length) * block_length - n
        x, ref_forwards = sdar_generate(
            forward,
            torch.tensor([prompt]),
            spec.mask_token_id,
            gen_length=gen,
            block_length=block_length,
            denoising_steps=steps,
            temperature=0.0,
            remasking_strategy=SDAR_STRATEGIES[sampler],
            confidence_threshold=0.9,  # the family default (the README's engine examples)
            stopping_criteria_idx=sorted(eos),
            topk_over_masks_only=steps < block_length,
            eb_threshold=eb_threshold,
        )
        want = cut_at_eos(x[0, n : n + gen], eos)
        extra = {} if eb_threshold is None else {"eb_threshold": eb_threshold}
        (got,), _, dec = run(
            model,
            tok,
            [prompt],
            max_tokens=gen,
            block_length=block_length,
            steps=steps,
            sampler=sampler,
            temperature=0.0,
            **extra,
        )
        assert got == want
        # The reference's cache costs one store forward per finished block; folded here.
        assert dec.nfe == ref_forwards - dec.backend.commits_saved
        out.append(dec.nfe)
    return out


# ---------------------------------------------------------------------------- LLaDA2 reference


def mlx_vlm_forward(path):
    """mlx-vlm's llada2_moe (an independent implementation) under the reference's mask."""
    from mlx_vlm.models.llada2_moe import Model
    from mlx_vlm.models.llada2_moe.config import ModelConfig

    cfg = json.loads((path / "config.json").read_text())
    model = Model(ModelConfig.from_dict(cfg))
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    model.load_weights(list(model.sanitize(weights).items()))
    language_model = model.language_model

    def forward(ids, keep):
        logits = language_model(
            mx.array(ids.numpy()), mask=mx.array(keep.numpy())[None, None]
        ).logits
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    return forward


@pytest.fixture(scope="module")
def llada2(family):
    path, model, tok = family("llada2_moe")
    return model, tok, mlx_vlm_forward(path)


def llada2_cases(block_length):
    """(prompt, max_tokens): requests that end on a block edge, and mid-block (11 + 32, 32 + 40),
    where the reference decodes the whole last block and cuts it."""
    edge = [(n, -(-(n + 40) // block_length) * block_length - n) for n in (7, 40)]
    cases = edge + [(11, 32), (32, 40)]
    assert any((n + gen) % block_length for n, gen in cases)
    return [(tokens(n, seed=n), gen) for n, gen in cases]


def without_eos(ids, eos_id):
    ids = [int(t) for t in ids]
    return ids[:-1] if ids and ids[-1] == eos_id else ids


@pytest.mark.parametrize(
    "block_length,steps,threshold",
    [(32, 32, 0.95), (32, 32, 0.7), (32, 8, 0.95), (16, 16, 0.95)],
)
def test_llada20_matches_reference_generate(llada2, block_length, steps, threshold):
    model, tok, forward = llada2
    spec = model.diffusion_spec
    eos = spec.eos_token_ids[0]
    for prompt, gen in llada2_cases(block_length):
        want, ref_forwards = llada20_generate(
            forward,
            torch.tensor([prompt]),
            block_length=block_length,
            steps=steps,
            gen_length=gen,
            threshold=threshold,
            eos_id=eos,
            mask_id=spec.mask_token_id,
        )
        (got,), _, dec = run(
            model,
            tok,
            [prompt],
            max_tokens=gen,
            block_length=block_length,
            steps=steps,
            threshold=threshold,
        )
        assert got == without_eos(want, eos)
        assert dec.nfe - dec.backend.prefill_forwards == ref_forwards


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_length,threshold,editing_threshold,max_post_steps",
    [
        (32, 0.95, 0.9, 16),
        (32, 0.7, 0.7, 4),
        (16, 0.7, 0.5, 4),
        (16, 0.9, 0.6, 8),
        (16, 0.7, 0.8, 16),
    ],
)
def test_llada21_editing_matches_reference_generate(
    llada2, block_length, threshold, editing_threshold, max_post_steps
):
    """steps == block_length: one mask a step at least, the reference's num_to_transfer=1."""
    model, tok, forward = llada2
    spec = model.diffusion_spec
    eos = spec.eos_token_ids[0]
    for prompt, gen in llada2_cases(block_length):
        want, ref_forwards, remasked = llada21_generate(
            forward,
            torch.tensor([prompt]),
            block_length=block_length,
            steps=block_length,
            gen_length=gen,
            threshold=threshold,
            editing_threshold=editing_threshold,
            max_post_steps=max_post_steps,
            eos_id=eos,
            mask_id=spec.mask_token_id,
        )
        assert remasked == 0, "the reference edited a token into the mask token: pick another case"
        (got,), (reason,), dec = run(
            model,
            tok,
            [prompt],
            max_tokens=gen,
            block_length=block_length,
            steps=block_length,
            threshold=threshold,
            editing_threshold=editing_threshold,
            max_post_steps=max_post_steps,
        )
        assert got == without_eos(want, eos)
        if reason == "length":  # the reference does not stop at an EOS; forwards agree otherwise
            assert dec.nfe - dec.backend.prefill_forwards == ref_forwards


# -------------------------------------------------------------------------------------- editing


def test_editing_rewrites_tokens_and_is_bounded_by_max_post_steps(family):
    _, model, tok = family("llada2_moe")
    mask = model.diffusion_spec.mask_token_id
    _, ids, dec = stream_events(
        model, tok, [tokens(7, seed=11)], max_tokens=25, editing_threshold=0.0, max_post_steps=3
    )
    before, edits, post_steps = None, 0, 0
    for event in dec.run(ids):
        if isinstance(event, StepEvent):
            now = event.canvas[0]
            if before is not None:
                edits += sum(a != b and a != mask for a, b in zip(before, now))
                post_steps += mask not in before
            before = now
    assert edits > 0
    assert post_steps == 3  # one block (25 tokens in columns 7..32): bounded by max_post_steps


def test_editing_never_touches_prompt_or_padding(family):
    """Row 0 is left-padded by a whole block and its prompt tail shares the second block with
    row 1's generated tokens: only decoded positions may be edited (those of the last block past
    max_tokens included, as in the reference, which edits the whole block but its prompt)."""
    _, model, tok = family("llada2_moe")
    mask = model.diffusion_spec.mask_token_id
    prompts = [tokens(7, seed=11), tokens(20, seed=12)]
    s, ids, dec = stream_events(
        model, tok, prompts, max_tokens=25, editing_threshold=0.0, max_post_steps=3
    )
    layout = Layout(ids, 25, s.block_length, True, mask)
    assert layout.pads == [32, 0] and layout.blocks() == [(20, 32), (32, 64)]
    seen = []

    class Watch(dec.backend_cls):
        def block_logits(self, x, start, stop):
            seen.append(np.array(x))  # the engine writes x in place
            return super().block_logits(x, start, stop)

    dec.backend_cls = Watch
    list(dec.run(ids))
    edits = 0
    initial, fixed = np.array(layout.tokens), ~np.array(layout.decoded)
    # Row 1's last block has positions past max_tokens (45..63): decoded, never returned.
    assert (np.array(layout.decoded) & ~np.array(layout.generated)).any(axis=1).tolist() == [
        False,
        True,
    ]
    for x in seen:
        n = x.shape[0]  # row 1 can only leave the batch first
        assert (x[fixed[:n]] == initial[:n][fixed[:n]]).all()
    for prev, x in zip(seen, seen[1:]):
        if prev.shape == x.shape:
            edits += ((prev != x) & (prev != mask)).sum()
    assert edits > 0, (
        "editing_threshold=0 never edited: the test could not see an unprotected position"
    )


def test_editing_off_never_changes_a_committed_token(family):
    _, model, tok = family("llada2_moe")
    mask = model.diffusion_spec.mask_token_id
    _, ids, dec = stream_events(model, tok, [tokens(7, 11)], max_tokens=25, threshold=0.7)
    before = None
    for event in dec.run(ids):
        if isinstance(event, StepEvent):
            now = event.canvas[0]
            if before is not None:
                assert all(a == b for a, b in zip(before, now) if a != mask)
            before = now


# ---------------------------------------------------------------------------- settings, errors


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


def test_editing_settings_for_a_family_without_editing(family):
    _, model, tok = family("sdar")
    for setting in ("editing_threshold", "max_post_steps"):
        with pytest.raises(SettingsError, match=f"unknown setting.*{setting} for the sdar family"):
            run(model, tok, [[1, 2, 3]], max_tokens=4, **{setting: 0.5})


def test_bad_editing_settings(family):
    _, model, tok = family("llada2_moe")
    with pytest.raises(
        SettingsError, match="max_post_steps only acts when editing_threshold is set"
    ):
        run(model, tok, [[1, 2, 3]], max_tokens=4, max_post_steps=4)
    with pytest.raises(SettingsError, match=r"editing_threshold must be in \[0, 1\]"):
        run(model, tok, [[1, 2, 3]], max_tokens=4, editing_threshold=1.5)
    with pytest.raises(SettingsError, match="max_post_steps must be an integer >= 0"):
        run(model, tok, [[1, 2, 3]], max_tokens=4, editing_threshold=0.9, max_post_steps=-1)


def test_untrained_block_length_is_allowed_and_logged_once(family, caplog):
    from mlx_dllm_models.engine import masked as engine

    _, model, tok = family("sdar")
    engine._WARNED_BLOCK_LENGTHS.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_dllm_models.engine"):
        run(model, tok, [[1, 2, 3]], max_tokens=4)  # the trained block size: silent
        assert not caplog.records
        for _ in range(2):
            run(model, tok, [[1, 2, 3]], max_tokens=8, block_length=8, steps=8)
    warnings = [
        r
        for r in caplog.records
        if "block_length=8 differs from the block size 4" in r.getMessage()
    ]
    assert len(warnings) == 1


def test_llada22_edit_control_tokens_are_never_proposed(family, tmp_path):
    """LLaDA2.2 decodes with substitution edits only: its DELETE / SPLIT tokens (insert/delete
    editing, out of scope) are never proposed, whether as a fill or as an edit."""
    import json
    import shutil
    from collections import Counter

    path, model, tok = family("llada2_moe")
    kw = dict(max_tokens=64, threshold=0.7, editing_threshold=0.6, max_post_steps=4)
    prompts = [tokens(9, 5), tokens(20, 6)]
    plain, _, _ = run(model, tok, prompts, **kw)
    common = [t for t, _ in Counter(t for row in plain for t in row).most_common(2)]
    assert len(common) == 2, "the fixture's output is too uniform for this test"

    v22 = tmp_path / "llada22"
    shutil.copytree(path, v22)
    cfg = json.loads((v22 / "config.json").read_text())
    cfg.update(delete_token_id=common[0], split_token_id=common[1])
    (v22 / "config.json").write_text(json.dumps(cfg))
    model22, tok22 = load_fixture(v22)
    assert set(model22.diffusion_spec.suppressed_token_ids) == set(common)
    out, _, decoder = run(model22, tok22, prompts, **kw)
    assert not set(common) & {t for row in out for t in row}
    assert all(len(row) > 0 for row in out)


# ------------------------------------------------------------------- LLaDA2.x editing modes

# A stand-in for LLaDA2.1's remote code: the signature of LLaDA2MoeModelLM.generate in
# LLaDA2.1-mini's modeling_llada2_moe.py (2.0's lacks editing_threshold, max_post_steps,
# num_to_transfer). Parsed by the loader, never run.
LLADA21_REMOTE_CODE = """
class LLaDA2MoeModelLM:
    def generate(self, inputs=None, temperature=0.0, block_length=32, steps=32, gen_length=2048,
                 top_p=None, top_k=None, eos_early_stop=False, minimal_topk=1, threshold=0.95,
                 editing_threshold=0.9, max_post_steps=16, eos_id=156892, mask_id=156895,
                 num_to_transfer=1):
        raise NotImplementedError
"""
LLADA20_REMOTE_CODE = LLADA21_REMOTE_CODE.replace(
    "threshold=0.95,\n                 editing_threshold=0.9, max_post_steps=16,", "threshold=0.95,"
).replace(",\n                 num_to_transfer=1", "")


def _llada2_with_remote_code(path, tmp_path, code, name):
    import shutil

    copy = tmp_path / name
    shutil.copytree(path, copy)
    (copy / "modeling_llada2_moe.py").write_text(code)
    return load_checkpoint(copy)  # the package's loader reads the remote code's signature


def test_llada21_checkpoints_default_to_quality_mode(family, tmp_path):
    """2.0 and 2.1 checkpoints have the same config and tokenizer files; the remote code's generate
    tells them apart. 2.1 decodes in the model card's Quality Mode (threshold 0.7, editing 0.5,
    max_post_steps 16), 2.0 as its generate (0.95, no editing)."""
    path, model, tok = family("llada2_moe")
    assert "editing_threshold" not in LLADA20_REMOTE_CODE
    model20, tok20 = _llada2_with_remote_code(path, tmp_path, LLADA20_REMOTE_CODE, "v20")
    model21, tok21 = _llada2_with_remote_code(path, tmp_path, LLADA21_REMOTE_CODE, "v21")
    for m, t, mode, values in (
        (model, tok, "off", (0.95, None)),  # no remote code: 2.0's defaults
        (model20, tok20, "off", (0.95, None)),
        (model21, tok21, "quality", (0.7, 0.5)),
    ):
        s, _, _ = stream_events(m, t, [[1, 2, 3]], max_tokens=4)
        assert s.editing_mode == mode
        assert (s.threshold, s.editing_threshold, s.max_post_steps) == (*values, 16)
    prompts = [tokens(7, 11), tokens(20, 12)]
    got, _, dec = run(model21, tok21, prompts, max_tokens=40)
    quality = dict(threshold=0.7, editing_threshold=0.5, max_post_steps=16)
    assert got == run(model, tok, prompts, max_tokens=40, **quality)[0]
    assert got != run(model, tok, prompts, max_tokens=40)[0], "the fixture cannot tell them apart"


def test_editing_modes_and_explicit_settings(family):
    _, model, tok = family("llada2_moe")

    def resolved(**kw):
        return stream_events(model, tok, [[1, 2, 3]], max_tokens=4, **kw)[0]

    s = resolved(editing_mode="speed")
    assert (s.threshold, s.editing_threshold, s.max_post_steps) == (0.5, 0.0, 16)
    s = resolved(editing_mode="quality", threshold=0.8, max_post_steps=4)
    assert (s.threshold, s.editing_threshold, s.max_post_steps) == (0.8, 0.5, 4)
    s = resolved(editing_mode="off")
    assert (s.threshold, s.editing_threshold) == (0.95, None)
    with pytest.raises(SettingsError, match="unknown editing_mode 'fast'.*quality, speed, off"):
        resolved(editing_mode="fast")


def test_llada22_checkpoints_default_to_quality_mode(family, tmp_path):
    """LLaDA2.2 is known from its config.json (its edit-control token ids)."""
    import shutil

    path, _, _ = family("llada2_moe")
    v22 = tmp_path / "llada22_mode"
    shutil.copytree(path, v22)
    cfg = json.loads((v22 / "config.json").read_text())
    cfg.update(delete_token_id=250, split_token_id=251)
    (v22 / "config.json").write_text(json.dumps(cfg))
    model22, tok22 = load_fixture(v22)
    s, _, _ = stream_events(model22, tok22, [[1, 2, 3]], max_tokens=4)
    assert (s.editing_mode, s.threshold, s.editing_threshold) == ("quality", 0.7, 0.5)


def test_entropy_bounded_settings(family):
    _, model, tok = family("sdar")

    def resolved(**kw):
        return stream_events(model, tok, [[1, 2, 3]], max_tokens=4, **kw)[0]

    assert resolved(sampler="entropy_bounded").eb_threshold == 0.35  # generate.py's default
    assert resolved().threshold == 0.9 and resolved().eb_threshold is None
    with pytest.raises(
        SettingsError, match="eb_threshold only acts with sampler='entropy_bounded'"
    ):
        resolved(eb_threshold=0.5)
    with pytest.raises(SettingsError, match="eb_threshold must be a number > 0"):
        resolved(sampler="entropy_bounded", eb_threshold=0)
    _, model2, tok2 = family("llada2_moe")
    with pytest.raises(SettingsError, match="unknown sampler 'entropy_bounded'"):
        stream_events(model2, tok2, [[1, 2, 3]], max_tokens=4, sampler="entropy_bounded")
