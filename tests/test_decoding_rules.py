"""Properties of the pure decoding rules, and agreement with plain transcriptions of the references."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mlx_dllm_models.decoding import (
    block_ranges,
    edit_commit,
    entropy_commit,
    factor_commit,
    filter_logits,
    quota_commit,
    threshold_commit,
    token_stats,
    transfer_schedule,
)

settings.register_profile("ci", max_examples=60, deadline=None)
settings.load_profile("ci")


@st.composite
def rows(draw, max_b=3, max_l=12):
    b = draw(st.integers(1, max_b))
    l = draw(st.integers(1, max_l))
    conf = draw(st.lists(st.floats(0, 1, allow_nan=False), min_size=b * l, max_size=b * l))
    cand = draw(st.lists(st.booleans(), min_size=b * l, max_size=b * l))
    return np.array(conf, np.float32).reshape(b, l), np.array(cand).reshape(b, l)


def _check_subset_and_progress(commit, cand):
    commit = np.array(commit)
    assert not (commit & ~cand).any(), "committed a non-candidate"
    has = cand.any(axis=1)
    assert (commit.sum(axis=1)[has] >= 1).all(), "no commit in a row that had candidates"


@given(rows(), st.integers(0, 12))
def test_quota_meets_quota_exactly(data, k):
    conf, cand = data
    commit = np.array(quota_commit(mx.array(conf), mx.array(cand), k))
    assert not (commit & ~cand).any()
    np.testing.assert_array_equal(commit.sum(axis=1), np.minimum(k, cand.sum(axis=1)))
    # and they are the most confident candidates
    for r in range(conf.shape[0]):
        if commit[r].any() and (cand[r] & ~commit[r]).any():
            assert conf[r][commit[r]].min() >= conf[r][cand[r] & ~commit[r]].max()


@pytest.mark.slow
@given(rows(), st.floats(0.01, 1.0), st.booleans())
def test_threshold(data, thr, strict):
    conf, cand = data
    commit = np.array(threshold_commit(mx.array(conf), mx.array(cand), thr, strict=strict))
    _check_subset_and_progress(commit, cand)
    passes = (conf > thr) if strict else (conf >= thr)
    assert (commit >= (cand & passes)).all(), "a candidate over the threshold was left out"
    extra = commit & ~passes
    assert (extra.sum(axis=1) <= 1).all(), "only the forced top-1 may be under the threshold"


def _factor_reference(conf, cand, f):
    """Fast-dLLM get_transfer_index_dynamic, transcribed, without its off-by-one."""
    out = np.zeros_like(cand)
    for r in range(conf.shape[0]):
        idx = np.where(cand[r])[0]
        if len(idx) == 0:
            continue
        order = idx[np.argsort(-conf[r][idx], kind="stable")]
        n_take = 1
        for n in range(2, len(order) + 1):
            if conf[r][order[n - 1]] < 1 - f / (n + 1):
                break
            n_take = n
        out[r, order[:n_take]] = True
    return out


@given(rows(), st.floats(0.05, 4.0))
def test_factor_matches_reference(data, f):
    conf, cand = data
    # distinct confidences so that the rank order is unique
    conf = conf + np.arange(conf.size, dtype=np.float32).reshape(conf.shape) * 1e-6
    commit = np.array(factor_commit(mx.array(conf), mx.array(cand), f))
    _check_subset_and_progress(commit, cand)
    np.testing.assert_array_equal(commit, _factor_reference(conf, cand, f))


@given(rows(), st.floats(0.0, 2.0))
def test_entropy_bound(data, bound):
    h, cand = data
    h = h * 3 + np.arange(h.size, dtype=np.float32).reshape(h.shape) * 1e-6
    commit = np.array(entropy_commit(mx.array(h), mx.array(cand), bound))
    _check_subset_and_progress(commit, cand)
    for r in range(h.shape[0]):
        idx = np.where(cand[r])[0]
        order = idx[np.argsort(h[r][idx])]
        before = np.cumsum(h[r][order].astype(np.float64)) - h[r][order]
        # a float32 sum may round either way right at the boundary: skip those cases
        assume(np.all(np.abs(before[1:] - bound) > 1e-5))
        expect = set(order[before <= bound]) | set(order[:1])
        assert set(np.where(commit[r])[0]) == expect


@given(st.lists(st.integers(0, 64), min_size=1, max_size=4), st.integers(1, 40))
def test_schedule_is_front_loaded_and_exact(masks, steps):
    sched = np.array(transfer_schedule(mx.array(masks), steps))
    for m, row in zip(masks, sched):
        assert row.sum() == m
        # LLaDA get_num_transfer_tokens
        ref = np.full(steps, m // steps)
        ref[: m % steps] += 1
        np.testing.assert_array_equal(row, ref)


def test_block_ranges():
    assert block_ranges(5, 20, 8) == [(5, 13), (13, 21), (21, 25)]
    assert block_ranges(5, 20, 8, aligned=True) == [(5, 8), (8, 16), (16, 24), (24, 25)]
    assert block_ranges(8, 8, 8, aligned=True) == [(8, 16)]


def test_edit_commit_never_forces():
    x0 = mx.array([[1, 2, 3]])
    tok = mx.array([[1, 5, 6]])
    conf = mx.array([[0.99, 0.95, 0.5]])
    editable = mx.array([[True, True, True]])
    out = np.array(edit_commit(x0, conf, tok, editable, 0.9))
    assert out.tolist() == [[False, True, False]]
    none = np.array(edit_commit(x0, conf * 0, tok, editable, 0.9))
    assert not none.any()


def test_token_stats_nan_safe_and_greedy():
    logits = mx.array([[[1.0, 3.0, float("nan"), 0.0], [float("nan")] * 4]])
    s = token_stats(logits)
    x0, conf, ent = (np.array(a) for a in s)
    assert x0[0, 0] == 1
    p = np.exp([1.0, 3.0, 0.0]) / np.exp([1.0, 3.0, 0.0]).sum()
    assert math.isclose(conf[0, 0], p[1], rel_tol=1e-5)
    assert math.isclose(ent[0, 0], -(p * np.log(p)).sum(), rel_tol=1e-5)
    assert conf[0, 1] == 0 and np.isinf(ent[0, 1])
    assert not np.isnan(conf).any()


def test_token_stats_suppressed_id_never_proposed_but_keeps_mass():
    logits = mx.array([[[0.0, 5.0, 1.0]]])
    s = token_stats(logits, suppress_ids=(1,))
    assert int(s.x0[0, 0]) == 2
    p = np.exp([0.0, 5.0, 1.0]) / np.exp([0.0, 5.0, 1.0]).sum()
    assert math.isclose(float(s.confidence[0, 0]), p[2], rel_tol=1e-5)


def test_token_stats_sampling_is_seeded_and_follows_the_distribution():
    logits = mx.array(np.log(np.array([[[0.7, 0.2, 0.1]]] * 1, np.float32))).reshape(1, 1, 3)
    logits = mx.broadcast_to(logits, (1, 4000, 3))
    a = token_stats(logits, temperature=1.0, key=mx.random.key(3))
    b = token_stats(logits, temperature=1.0, key=mx.random.key(3))
    assert np.array_equal(np.array(a.x0), np.array(b.x0))
    freq = np.bincount(np.array(a.x0).ravel(), minlength=3) / 4000
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.03)


def test_raw_vs_sampled_confidence():
    logits = mx.array([[[2.0, 1.0, 0.0]]])
    raw = float(token_stats(logits, confidence="raw").confidence[0, 0])
    samp = float(token_stats(logits, top_k=2, confidence="sampled").confidence[0, 0])
    assert math.isclose(raw, np.exp(2) / np.exp([2, 1, 0]).sum(), rel_tol=1e-5)
    assert math.isclose(samp, np.exp(2) / np.exp([2, 1]).sum(), rel_tol=1e-5)


def test_top_p_drops_tokens_once_the_mass_before_them_exceeds_top_p():
    logits = mx.array(np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)))
    kept = np.isfinite(np.array(filter_logits(logits, top_p=0.7)))
    assert kept.tolist() == [[True, True, False, False]]
    kept = np.isfinite(np.array(filter_logits(logits, top_p=0.85)))
    assert kept.tolist() == [[True, True, True, False]]
    kept = np.isfinite(np.array(filter_logits(logits, top_k=1)))
    assert kept.tolist() == [[True, False, False, False]]
