"""Self-speculation's rows share each forward (issue #26 §5): Nemotron's `mode="self_spec"` decodes
a batch in one forward a round, each row at columns of its own (engine/causal_prefix.py's
row_forwards over cache.RowKVCache and masks.rows_prefix_mask). At temperature 0 each row's tokens
are those it gets alone (greedy AR decoding), whatever its prompt length and however many drafts it
keeps each round, and the batch takes as many forwards as its longest row alone; concurrent server
requests share those forwards."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures import nemotron as fx
from helpers import job_gone_after_looks, load_fixture, spy_forwards, step_to_the_end
from mlx_dllm_models.cache import RowKVCache
from mlx_dllm_models.engine import join_policy
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.masks import causal_prefix_mask, rows_prefix_mask
from mlx_dllm_models.server.scheduler import Job, Scheduler

PROMPTS = fx.prompts(4, seed=3)  # 4 prompts of different lengths


@pytest.fixture(scope="module")
def loaded(fixture_dir):
    return load_fixture(fx.shared_checkpoint(fixture_dir))


class BatchOracle:
    """The fixture's model, except that at mask inputs (the draft windows) row r predicts
    `truths[r][column]`, a wrong token at the columns of `wrongs[r]`: drafts agree with the AR
    head in runs whose lengths differ by row (an untrained model's drafts almost never agree), so
    the rows keep different numbers of tokens each round; verification stays the real model's.
    `rows`: the prompts the batch's rows are (rows leave the batch as they finish)."""

    def __init__(self, model, truths, wrongs, rows):
        self.model, self.layers, self.diffusion_spec = model, model.layers, model.diffusion_spec
        width = max(len(t) for t in truths)
        target = np.zeros((len(truths), width), dtype=np.int64)
        for r, (truth, wrong) in enumerate(zip(truths, wrongs)):
            target[r, : len(truth)] = truth
            target[r, list(wrong)] = (target[r, list(wrong)] + 1) % fx.VOCAB
        self.target, self.rows = mx.array(target), list(rows)

    def __call__(self, inputs, cache=None, mask=None, head_span=None):
        logits = self.model(inputs, cache=cache, mask=mask, head_span=head_span)
        lo = head_span[0] if head_span is not None else 0
        first = mx.array(0 if cache is None else cache[0].offset).reshape(-1, 1) + lo
        cols = first + mx.arange(logits.shape[1])[None]
        cols = mx.minimum(mx.broadcast_to(cols, logits.shape[:2]), self.target.shape[1] - 1)
        want = mx.take_along_axis(self.target[mx.array(self.rows)], cols, axis=1)
        oracle = 20.0 * (mx.arange(fx.VOCAB)[None, None] == want[..., None])
        drafting = (inputs[:, lo : lo + logits.shape[1]] == fx.MASK)[..., None]
        return mx.where(drafting, oracle, logits)


def _tracking(forwards, oracle):
    """The backend's row forwards, telling `oracle` which rows are left after each select."""

    class Tracking(forwards):
        def select(self, idx):
            oracle.rows = [oracle.rows[i] for i in idx]
            return super().select(idx)

    return Tracking


def decode(model, tok, prompts, oracle=None, **kw):
    """Each row's tokens and the decoder (its nfe, drafted and accepted counts)."""
    s, ids, decoder = stream_events(model, tok, prompts, mode="self_spec", **kw)
    if oracle is not None:
        decoder.model = oracle
        decoder.row_forwards = _tracking(decoder.row_forwards, oracle)
    out = [[] for _ in prompts]
    for event in decoder.run(ids):
        for row, tokens in zip(event.rows, event.tokens):
            out[row] += tokens
    return out, decoder


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["auto", "none"])
def test_batch_rows_equal_their_single_runs(loaded, cache):
    model, tok = loaded
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    batch, decoder = decode(model, tok, PROMPTS, max_tokens=30, cache=cache)
    singles = [decode(model, tok, [p], max_tokens=30, cache=cache) for p in PROMPTS]
    for p, got, (alone, _) in zip(PROMPTS, batch, singles):
        assert got == alone[0] == fx.ar_greedy(model, p, 30)
    nfes = [d.nfe for _, d in singles]
    # Each row's rounds are its own; the batch runs them together.
    assert decoder.nfe == max(nfes) < sum(nfes), (decoder.nfe, nfes)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["auto", "none"])
def test_rows_keeping_different_drafts_equal_their_single_runs(loaded, cache):
    model, tok = loaded
    n = 36  # the longest prompt (25) + n within the fixture's context of 64
    ars = [fx.ar_greedy(model, p, n) for p in PROMPTS]
    truths = [p + ar + [0] * 64 for p, ar in zip(PROMPTS, ars)]
    # Row 0: drafts right in runs of 10; row 1: always wrong; row 2: always right; row 3: runs of 3.
    wrongs = [
        range(len(PROMPTS[0]) + 5, len(truths[0]), 11),
        range(len(truths[1])),
        [],
        range(len(PROMPTS[3]) + 2, len(truths[3]), 4),
    ]
    oracle = BatchOracle(model, truths, wrongs, range(4))
    batch, decoder = decode(model, tok, PROMPTS, oracle, max_tokens=n, cache=cache)
    singles = []
    for r, p in enumerate(PROMPTS):
        single = BatchOracle(model, truths, wrongs, [r])
        singles.append(decode(model, tok, [p], single, max_tokens=n, cache=cache))
    for got, ar, (alone, _) in zip(batch, ars, singles):
        assert got == alone[0] == ar
    nfes = [d.nfe for _, d in singles]
    assert len(set(nfes)) >= 3, f"the rows' acceptance patterns should differ: {nfes}"
    assert decoder.nfe == max(nfes) < sum(nfes), (decoder.nfe, nfes)
    assert decoder.accepted == sum(d.accepted for _, d in singles) > 0
    assert decoder.drafted == sum(d.drafted for _, d in singles)


def test_thinking_budget_and_logprobs_per_row(loaded):
    model, tok = loaded
    free = [decode(model, tok, [p], max_tokens=16)[0][0] for p in PROMPTS]
    marker = free[0][1]  # row 0 produces it within the budget; the others are forced to
    kw = dict(max_tokens=16, max_thinking_tokens=6, end_think_token_id=marker, logprobs=2)
    s, ids, decoder = stream_events(model, tok, PROMPTS, mode="self_spec", **kw)
    batch = [([], []) for _ in PROMPTS]
    for event in decoder.run(ids):
        for row, tokens, entries in zip(event.rows, event.tokens, event.logprobs):
            batch[row][0].extend(tokens)
            batch[row][1].extend(entries)
    forced = 0
    for p, (tokens, entries) in zip(PROMPTS, batch):
        s, ids, alone = stream_events(model, tok, [p], mode="self_spec", **kw)
        events = list(alone.run(ids))
        assert tokens == [t for e in events for t in e.tokens[0]]
        want = [x for e in events for x in e.logprobs[0]]
        assert [e.token for e in entries] == tokens == [e.token for e in want]
        assert [[t for t, _ in e.top] for e in entries] == [[t for t, _ in e.top] for e in want]
        np.testing.assert_allclose(
            [e.logprob for e in entries], [e.logprob for e in want], rtol=1e-4, atol=1e-5
        )
        forced += tokens[6:7] == [marker] and marker not in tokens[:6]
    assert forced >= 1


@pytest.mark.slow
def test_sampled_batch_is_seeded_and_cache_exact(loaded):
    model, tok = loaded
    kw = dict(max_tokens=16, temperature=0.8, seed=5)
    a, _ = decode(model, tok, PROMPTS, **kw)
    assert a == decode(model, tok, PROMPTS, **kw)[0]
    assert a == decode(model, tok, PROMPTS, cache="none", **kw)[0]
    assert a != decode(model, tok, PROMPTS, **{**kw, "seed": 6})[0]
    assert all(fx.MASK not in row for row in a)


def test_concurrent_server_requests_share_forwards(loaded):
    """Three self_spec requests (one constrained) submitted together share one run: each equals
    its single call, in fewer model forwards than the three calls take."""
    model, tok = loaded
    cases = [
        (PROMPTS[0], {}),
        (PROMPTS[1], dict(regex="[a-z]{2,6}")),
        (PROMPTS[2], {}),
    ]
    alone = []
    for prompt, c in cases:
        calls = []
        with spy_forwards(model, lambda *a: calls.append(1)):
            tokens, _ = decode(model, tok, [prompt], max_tokens=20, **c)
        alone.append((tokens[0], len(calls)))
    scheduler = Scheduler(model, tok, max_batch=4)
    calls = []
    with spy_forwards(model, lambda *a: calls.append(1)):
        jobs = [
            scheduler.submit(Job(p, dict(mode="self_spec", max_tokens=20, **c))) for p, c in cases
        ]
        step_to_the_end(scheduler)
    for job, (tokens, _) in zip(jobs, alone):
        assert job.tokens == tokens
    assert scheduler.max_rows == 3
    assert len(calls) == scheduler.forwards == max(n for _, n in alone)
    assert len(calls) < sum(n for _, n in alone)


def test_a_later_request_joins_a_running_batch_and_a_cancelled_one_leaves(loaded):
    """Self-speculation's rows are AR decoding: a request that arrives while a run decodes joins
    it at the next round (the run restarts over [prompt ; returned tokens], each row with what is
    left of its own max_tokens), and a cancelled row leaves at its next round; every other row's
    tokens are its single call's. Not with a thinking budget (counted from the request's start)."""
    model, tok = loaded
    alone = [decode(model, tok, [p], max_tokens=n)[0][0] for p, n in zip(PROMPTS, (30, 20, 30))]
    assert all(len(a) > 8 for a in alone)
    scheduler = Scheduler(model, tok, max_batch=4)
    first = scheduler.submit(Job(PROMPTS[0], dict(mode="self_spec", max_tokens=30)))
    for _ in range(4):
        scheduler.step()
    assert 0 < len(first.tokens) < len(alone[0])
    later = scheduler.submit(Job(PROMPTS[1], dict(mode="self_spec", max_tokens=20)))
    gone = scheduler.submit(
        job_gone_after_looks(PROMPTS[2], dict(mode="self_spec", max_tokens=30), looks=6)
    )
    step_to_the_end(scheduler)
    assert scheduler.joins == 1 and scheduler.max_rows == 3
    assert first.tokens == alone[0] and later.tokens == alone[1]
    assert gone.done and len(gone.tokens) < len(alone[2])
    assert gone.tokens == alone[2][: len(gone.tokens)]
    spec = model.diffusion_spec
    settings = stream_events(model, tok, PROMPTS[:1], mode="self_spec", max_tokens=16)[0]
    assert join_policy(spec, settings).joins and join_policy(spec, settings).drops_rows
    think = dict(max_thinking_tokens=4, end_think_token_id=5, max_tokens=16)
    settings = stream_events(model, tok, PROMPTS[:1], mode="self_spec", **think)[0]
    assert not join_policy(spec, settings).joins


@pytest.fixture(scope="module")
def with_adapter(tmp_path_factory):
    return load_fixture(fx.build_with_draft_adapter(tmp_path_factory.mktemp("lora") / "ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [dict(cache="auto"), dict(cache="none"), dict(draft_threshold=0.99)],
    ids=["adapter", "adapter-recompute", "adapter-threshold"],
)
def test_draft_adapter_rows_equal_their_single_runs(with_adapter, kw):
    """The draft adapter's rounds (linear_spec_generate: a drafting forward with the adapter on,
    a verifying one with it off) batched; with draft_threshold, a round drafts until every row's
    block is filled (a filled row is left as it is)."""
    model, tok = with_adapter
    batch, decoder = decode(model, tok, PROMPTS, max_tokens=24, **kw)
    singles = [decode(model, tok, [p], max_tokens=24, **kw) for p in PROMPTS]
    for p, got, (alone, _) in zip(PROMPTS, batch, singles):
        assert got == alone[0] == fx.ar_greedy(model, p, 24)
    nfes = [d.nfe for _, d in singles]
    if "draft_threshold" in kw:
        # A round's draft forwards are the most any row needs.
        assert max(nfes) <= decoder.nfe < sum(nfes), (decoder.nfe, nfes)
    else:
        assert decoder.nfe == max(nfes) < sum(nfes), (decoder.nfe, nfes)
    assert decoder.drafted == sum(d.drafted for _, d in singles)


def test_rows_prefix_mask():
    # One row: causal_prefix_mask's rows from the forward's first column.
    got = rows_prefix_mask([3], [5], [9], 6)
    assert mx.array_equal(got, causal_prefix_mask(6, 5, offset=3))
    # Row 1 is shorter: its keys past its stop are hidden, its padding queries see column 0.
    got = np.array(rows_prefix_mask([3, 1], [5, 2], [9, 4], 6))[:, 0]
    assert got.shape == (2, 6, 9)
    np.testing.assert_array_equal(got[1, :3, :4], np.array(causal_prefix_mask(3, 2, 1))[0, 0])
    assert not got[1, :3, 4:].any()
    assert (got[1, 3:] == (np.arange(9) == 0)).all()


def test_row_cache_refuses_a_write_past_its_width():
    cache = RowKVCache(1, 2, 8)
    with pytest.raises(ValueError, match="past the width 8"):
        cache.place([2, 6], [5, 9], 3)
