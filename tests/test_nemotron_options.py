"""Nemotron-Labs-Diffusion's options of NVIDIA's chat_utils.generate_with_prefix_cache_block_diff:
`causal_context` and the thinking budget (`max_thinking_tokens` / `end_think_token_id`).

Diffusion mode at temperature 0 is token-identical to a plain transcription of the reference
(tests/reference/nemotron_reference.py) running over mlx-vlm's model; the KV cache equals full
recompute and a left-padded batch equals its rows one by one. Self-speculation with the budget is
token-identical to a transcription of the remote code's ar_generate.
"""

import pytest

from fixtures import nemotron as fx
from helpers import (
    checkpoint_fixtures,
    load_fixture,
    spy_forwards,
    step_to_the_end,
    submit_while_running,
)
from mlx_dllm_models import batch_generate_diffusion, stream_generate_diffusion
from mlx_dllm_models.cli_common import add_setting_flags, chosen_settings
from mlx_dllm_models.engine import BlockEvent
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.settings import SettingsError, resolve_settings
from reference.nemotron_reference import (
    VlmForward,
    ar_generate,
    generate_with_prefix_cache_block_diff,
)

L = fx.BLOCK_SIZE
N = 3 * L  # new tokens of the parity runs


PROMPTS = fx.prompts(3, seed=2)


checkpoint, loaded = checkpoint_fixtures(
    "nemotron", fx.build, name="checkpoint", loader=load_fixture
)


@pytest.fixture(scope="module")
def vlm(checkpoint):
    return VlmForward(fx.mlx_vlm_model(checkpoint))


def _ours(model, tok, prompt, **kw):
    out, last = [], None
    for r in stream_generate_diffusion(model, tok, prompt, **kw):
        out.extend(r.tokens)
        last = r
    return out, last


def _cut(tokens):
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(fx.EOS)] if fx.EOS in tokens else tokens


def _reference(vlm, prompt, causal_context, threshold=None, steps=L, **kw):
    x, _ = generate_with_prefix_cache_block_diff(
        vlm,
        [prompt],
        steps * N // L,
        N,
        L,
        fx.MASK,
        threshold=threshold,
        causal_context=causal_context,
        eos_token_id=fx.EOS,
        **kw,
    )
    new = x[0, len(prompt) :].tolist()
    # The reference may commit the mask id (the untrained head's argmax); ours never does. The
    # prompts are chosen so that it does not.
    assert fx.MASK not in new
    return _cut(new)


def _sampler(threshold):
    return dict(sampler="quota") if threshold is None else dict(threshold=threshold)


@pytest.mark.parametrize("causal_context", [True, False])
@pytest.mark.parametrize("threshold", [None, 0.6])
def test_causal_context_matches_reference(loaded, vlm, causal_context, threshold):
    model, tok = loaded
    rates = []
    for prompt in PROMPTS:
        want = _reference(vlm, prompt, causal_context, threshold)
        got, last = _ours(
            model, tok, prompt, max_tokens=N, causal_context=causal_context, **_sampler(threshold)
        )
        assert got == want
        rates.append(last.tokens_per_forward)
    if threshold is not None:
        assert max(rates) > 1.5, "fixture not confident: threshold never beats one per step"


def test_causal_context_changes_the_output(loaded):
    model, tok = loaded
    differs = [
        _ours(model, tok, p, max_tokens=N)[0]
        != _ours(model, tok, p, max_tokens=N, causal_context=False)[0]
        for p in PROMPTS
    ]
    assert all(differs)


@pytest.fixture(scope="module")
def free_runs(loaded):
    """Each prompt's output without a budget, per causal_context."""
    model, tok = loaded
    return {
        cc: [_ours(model, tok, p, max_tokens=N, causal_context=cc)[0] for p in PROMPTS]
        for cc in (True, False)
    }


def _marker(runs, budget):
    """A token that row 0 produces in its first block and the other rows not before `budget`:
    the end-of-thinking marker of the test, so that row 0 has produced it and the others have not."""
    for t in runs[0][:L]:
        if all(t not in r[:budget] for r in runs[1:]) and t != fx.MASK:
            return t
    pytest.fail("no token of row 0's first block is absent from the other rows")


@pytest.mark.parametrize("causal_context", [True, False])
@pytest.mark.parametrize("budget", [0, 3, L, L + 5, 10 * N])
def test_thinking_budget_matches_reference(loaded, vlm, free_runs, causal_context, budget):
    """Budgets: 0, inside the first block, on a block boundary, inside the second block, past the
    output. Row 0 has produced the marker in its first block: when the budget falls after that
    block, it is left alone; the others get the marker at the budget position."""
    model, tok = loaded
    runs = free_runs[causal_context]
    marker = _marker(runs, L + 5)
    think = dict(max_thinking_tokens=budget, end_think_token_id=marker)
    for row, prompt in enumerate(PROMPTS):
        want = _reference(vlm, prompt, causal_context, threshold=0.9, **think)
        got, _ = _ours(
            model, tok, prompt, max_tokens=N, causal_context=causal_context, threshold=0.9, **think
        )
        assert got == want
        free = runs[row]
        if budget >= N:
            assert got == free  # the budget is never reached
        elif row == 0 and budget >= L:
            assert got == free  # it thought less than the budget: nothing forced
        else:
            assert budget < len(got) and got[budget] == marker
            done = budget - budget % L  # the earlier blocks' tokens
            assert got[:done] == free[:done]


@pytest.mark.parametrize("causal_context", [True, False])
def test_thinking_budget_schedule(loaded, vlm, free_runs, causal_context):
    """The quota schedule counts the block's masks after the marker is placed: with fewer steps
    than positions, counting it would move a token from one step to another."""
    model, tok = loaded
    marker = _marker(free_runs[causal_context], L + 5)
    kw = dict(max_thinking_tokens=L + 3, end_think_token_id=marker)
    for prompt in PROMPTS:
        want = _reference(vlm, prompt, causal_context, steps=L // 2, **kw)
        got, _ = _ours(
            model,
            tok,
            prompt,
            max_tokens=N,
            causal_context=causal_context,
            sampler="quota",
            steps=L // 2,
            **kw,
        )
        assert got == want


def _think(budget, marker, **kw):
    return dict(max_thinking_tokens=budget, end_think_token_id=marker, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("causal_context", [True, False])
def test_cache_none_and_batch_equal_kv_one_by_one(loaded, free_runs, causal_context):
    model, tok = loaded
    marker = _marker(free_runs[causal_context], L + 5)
    prompts = fx.prompts(4, seed=5)
    assert len({len(p) for p in prompts}) > 1  # left padding
    kw = _think(11, marker, max_tokens=N, causal_context=causal_context, threshold=0.7)
    one_by_one = [_ours(model, tok, p, **kw)[0] for p in prompts]
    assert sum(r[11:12] == [marker] for r in one_by_one) >= 3
    # Rows that leave the batch at a block boundary (their budgets end there): the backend keeps
    # the survivors' rows.
    budgets = [L, N, 2 * L, N]
    singles = [_ours(model, tok, p, **dict(kw, max_tokens=b))[0] for p, b in zip(prompts, budgets)]
    for cache in ("auto", "none"):
        assert [_ours(model, tok, p, cache=cache, **kw)[0] for p in prompts] == one_by_one
        batch = batch_generate_diffusion(model, tok, prompts, cache=cache, **kw)
        assert batch.tokens == one_by_one
        _, ids, decoder = stream_events(model, tok, prompts, cache=cache, **kw)
        got = [[] for _ in prompts]
        rows_seen = set()
        for event in decoder.run(ids, budgets=budgets):
            if isinstance(event, BlockEvent):
                rows_seen.add(len(event.rows))
                for row, tokens in zip(event.rows, event.tokens):
                    got[row] += tokens
        assert got == singles and rows_seen == {4, 3, 2}


def test_bidirectional_context_forwards(loaded):
    """causal_context=False: the prompt is encoded once (bidirectionally), each denoising step runs
    over the block only, each finished block but the last is encoded once; no block is seeded, so
    the quota sampler spends block_length steps on each."""
    model, tok = loaded
    prompt, seen = PROMPTS[0], []
    with spy_forwards(model, lambda inputs, *_: seen.append(inputs.shape[1])):
        _, last = _ours(model, tok, prompt, max_tokens=N, sampler="quota", causal_context=False)
    steps = [L] * L
    assert seen == [len(prompt)] + steps + [L] + steps + [L] + steps
    assert last.nfe == len(seen)


def test_bidirectional_context_reuses_no_chat_kv(loaded):
    """The K/V of a bidirectional prompt depend on all of it: a finished run offers none to a next
    turn, and a prior from a causal run is not read."""
    model, tok = loaded
    prompt = PROMPTS[1]
    _, ids, causal = stream_events(model, tok, [prompt], max_tokens=L)
    list(causal.run(ids))
    prior = causal.kv_prefix()
    assert prior is not None
    _, ids, decoder = stream_events(model, tok, [prompt], max_tokens=L, causal_context=False)
    fresh = [e.tokens[0] for e in decoder.run(ids) if hasattr(e, "finished")]
    assert decoder.kv_prefix() is None
    _, ids, decoder = stream_events(model, tok, [prompt], max_tokens=L, causal_context=False)
    reused = [e.tokens[0] for e in decoder.run(ids, prior=prior) if hasattr(e, "finished")]
    assert reused == fresh and decoder.backend.reused == 0


@pytest.mark.parametrize(
    "extra", [dict(causal_context=False), dict(max_thinking_tokens=L + 2, end_think_token_id=300)]
)
def test_server_batches_these_at_arrival(checkpoint, extra):
    """A restart of a running batch (a join) would re-encode a row's committed blocks together
    with its prompt and count its thinking budget from there: these requests batch at arrival,
    and each gets the tokens of a single call."""
    from mlx_dllm_models import load
    from mlx_dllm_models.server import Job, Scheduler

    model, tokenizer = load(checkpoint)
    scheduler = Scheduler(model, tokenizer, max_batch=4)
    prompts = ["hello world", "a longer prompt", "x"]
    settings = dict(max_tokens=3 * L, sampler="threshold", threshold=0.6, **extra)
    jobs = submit_while_running(scheduler, [Job(p, dict(settings)) for p in prompts])
    step_to_the_end(scheduler)
    assert scheduler.joins == 0 and all(j.done for j in jobs)
    for job, prompt in zip(jobs, prompts):
        assert job.tokens == _ours(model, tokenizer, prompt, **settings)[0]


# ------------------------------------------------------------------------------ self-speculation


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(cache="none"), dict(draft_threshold=0.5)])
def test_self_spec_budget_equals_ar_generate(loaded, vlm, free_runs, kw):
    model, tok = loaded
    marker = _marker(free_runs[True], L + 5)
    forced = 0
    for prompt in PROMPTS:
        for budget in (0, 6):
            want = _cut(ar_generate(vlm, [prompt], 16, fx.EOS, budget, marker))
            got, _ = _ours(
                model, tok, prompt, max_tokens=16, mode="self_spec", **_think(budget, marker), **kw
            )
            assert got == want
            forced += got[budget : budget + 1] == [marker]
    assert forced >= 4


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(causal_context="no"), "causal_context must be true or false"),
        (dict(max_thinking_tokens=5), "max_thinking_tokens only acts when end_think_token_id"),
        (dict(end_think_token_id=7), "end_think_token_id only acts when max_thinking_tokens"),
        (dict(max_thinking_tokens=-1, end_think_token_id=7), "max_thinking_tokens must be"),
        (dict(max_thinking_tokens=2.5, end_think_token_id=7), "max_thinking_tokens must be"),
        (dict(max_thinking_tokens=4, end_think_token_id=fx.VOCAB), "outside the vocabulary"),
        (dict(max_thinking_tokens=4, end_think_token_id=-3), "end_think_token_id must be"),
        (dict(max_thinking_tokens=4, end_think_token_id=fx.MASK), "is the mask token id"),
        (dict(mode="self_spec", causal_context=False), "causal_context only acts with mode"),
    ],
)
def test_bad_settings(loaded, kw, message):
    model, tok = loaded
    with pytest.raises(SettingsError, match=message):
        _ours(model, tok, PROMPTS[0], max_tokens=4, **kw)


@pytest.mark.parametrize("name", ["causal_context", "max_thinking_tokens", "end_think_token_id"])
def test_other_families_refuse(name):
    from mlx_dllm_models.spec import BIDIRECTIONAL, DiffusionSpec

    spec = DiffusionSpec(family="dream", attention=BIDIRECTIONAL, mask_token_id=5)
    with pytest.raises(SettingsError, match=f"{name} is a setting of the nemotron family only"):
        resolve_settings(spec, {name: 1})


def test_cli_flags():
    import argparse

    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    args = parser.parse_args(
        ["--causal-context", "false", "--max-thinking-tokens", "64", "--end-think-token-id", "9"]
    )
    assert chosen_settings(args) == dict(
        causal_context=False, max_thinking_tokens=64, end_think_token_id=9
    )
