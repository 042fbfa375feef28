"""A cancelled row leaves its batch at the next denoising step, for every decoder (issue #27: a
disconnected client's row once rode along to its block's end, a minute at 2,050 positions on a
CPU). `run(cancelled=)`: from the step after the cancellation every forward is over the other rows
only (counted by wrapping the model), and those rows' tokens are their single runs' at
temperature 0 (and above it where each row draws from its own stream): the masked loop over each
backend (full recompute, the block-causal prefix cache, Fast-dLLM's approximate prefix / dual
caches and v2's sub-block cache, the causal-prefix cache, LaViDa's prefix-DLM cache; with
log-probabilities, with LLaDA2.1's token editing, with seeded draws), DiffusionGemma's canvas (each
row's noise stream its own), WeDLM's window, self-speculation with a thinking budget; and the
server's scheduler, which drops such a row without ending or restarting the run."""

import pytest

from fixtures import build_once
from fixtures import diffusion_gemma as dg_fx
from fixtures import fast_dllm_v2 as v2_fx
from fixtures import llada2 as l2_fx
from fixtures import nemotron as nem_fx
from fixtures import wedlm as wedlm_fx
from fixtures.lavida import build_lavida
from fixtures.llada import build_llada
from fixtures.sdar import build_sdar
from helpers import job_gone_after_looks, load_fixture, spy_forwards
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.server import Job, Scheduler

PROMPTS = ["a story about the sea", "hi", "tell me what you know about it"]

# name -> (fixture folder, builder, settings, events before the cancellation)
CASES = {
    "full_recompute": (
        "safety_llada",
        build_llada,
        dict(max_tokens=16, block_length=8, steps=8),
        2,
    ),
    "fast_dllm_prefix": (
        "safety_llada",
        build_llada,
        dict(max_tokens=16, block_length=8, steps=8, cache="prefix"),
        3,
    ),
    "fast_dllm_dual": (
        "safety_llada",
        build_llada,
        dict(max_tokens=16, block_length=8, steps=8, cache="dual"),
        3,
    ),
    "logprobs": (
        "safety_llada",
        build_llada,
        dict(max_tokens=16, block_length=8, steps=8, logprobs=2),
        2,
    ),
    "seeded_draws": (  # each row draws from its own stream: the others' draws are unchanged
        "safety_llada",
        build_llada,
        dict(max_tokens=16, block_length=8, steps=8, temperature=0.8, seed=3),
        2,
    ),
    "prefix_dlm": ("lavida", build_lavida, dict(max_tokens=16, block_length=8, steps=8), 2),
    "prefix_cache": (
        "safety_build_sdar",
        build_sdar,
        dict(max_tokens=16, block_length=8, steps=8),
        7,  # the third block's first step (the threshold sampler ends the others in two)
    ),
    "sub_block_cache": ("fast_dllm_v2", v2_fx.build, dict(max_tokens=40, cache="sub_block"), 8),
    "token_editing": (
        "llada2_moe",
        l2_fx.build,
        dict(max_tokens=16, block_length=8, steps=8, editing_threshold=0.6, max_post_steps=2),
        2,
    ),
    "causal_prefix": (
        "nemotron",
        nem_fx.build,
        dict(max_tokens=16, block_length=8, steps=8),
        2,
    ),
    "self_spec_thinking_budget": (
        "nemotron",
        nem_fx.build,
        dict(mode="self_spec", max_tokens=16, max_thinking_tokens=5, end_think_token_id=300),
        1,
    ),
    "wedlm": ("wedlm_wedlm", wedlm_fx.build, dict(max_tokens=16, block_length=4), 2),
    "canvas": (
        "safety_gemma",
        dg_fx.build,
        dict(max_tokens=2 * dg_fx.CANVAS_LENGTH, max_denoising_steps=12, seed=5),
        3,
    ),
}

_LOADED = {}


def loaded(fixture_dir, folder, builder):
    if folder not in _LOADED:
        _LOADED[folder] = load_fixture(build_once(fixture_dir / folder, builder))
    return _LOADED[folder]


class Rows:
    """The rows of every forward of `model` (its decoder's `decode` for the canvas)."""

    def __init__(self, model, monkeypatch):
        self.model, self.monkeypatch, self.sizes = model, monkeypatch, []

    def __enter__(self):
        if hasattr(self.model, "decode"):
            decode = self.model.decode

            def counted(canvas, *args, **kwargs):
                self.sizes.append(canvas.shape[0])
                return decode(canvas, *args, **kwargs)

            self.monkeypatch.setattr(self.model, "decode", counted)
            self.spy = None
            return self
        self.spy = spy_forwards(self.model, lambda x, *rest: self.sizes.append(x.shape[0]))
        self.spy.__enter__()
        return self

    def __exit__(self, *exc):
        if self.spy is not None:
            return self.spy.__exit__(*exc)
        self.monkeypatch.undo()


def decode(model, tok, prompts, settings, cancel=None):
    """Each row's tokens of one run; with `cancel` = (row, n): that row is cancelled after the
    run's n-th event. Also the rows of every forward, where the cancellation fell among them, and
    the events that came after it."""
    _, ids, decoder = stream_events(model, tok, prompts, **settings)
    cancelled, tokens, after, mark = set(), [[] for _ in prompts], [], None
    with Rows(model, pytest.MonkeyPatch()) as rows:
        for n, event in enumerate(decoder.run(ids, cancelled=cancelled), start=1):
            if mark is not None:
                after.append(event)
            if hasattr(event, "finished"):
                for row, new in zip(event.rows, event.tokens):
                    tokens[row] += new
            if cancel is not None and n == cancel[1]:
                cancelled.add(cancel[0])
                mark = len(rows.sizes)
    return tokens, rows.sizes, mark, after


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cancelled_row_leaves_at_the_next_step(fixture_dir, case):
    folder, builder, settings, when = CASES[case]
    model, tok = loaded(fixture_dir, folder, builder)
    gone = 0
    tokens, sizes, mark, after = decode(model, tok, PROMPTS, settings, cancel=(gone, when))
    n = len(PROMPTS)
    assert mark is not None and max(sizes[:mark]) == n, (case, sizes)
    # The run went on over the others alone, from its very next forward.
    assert sizes[mark:] and max(sizes[mark:]) <= n - 1, (case, mark, sizes)
    assert all(gone not in event.rows for event in after)
    if case != "self_spec_thinking_budget":  # a round is its step and its block at once
        assert not hasattr(after[0], "finished"), f"{case}: the cancellation was not mid-block"
    for row in range(1, n):
        alone = decode(model, tok, [PROMPTS[row]], settings)[0][0]
        assert tokens[row] == alone, (case, row)
    assert any(tokens[1:]), "nothing generated: the test shows nothing"
    print(f"{case}: forwards' rows {sizes[:mark]} | {sizes[mark:]}")


def test_the_server_drops_a_canvas_row_mid_canvas_and_the_run_goes_on(fixture_dir):
    """DiffusionGemma's rows cannot join a running batch (their noise streams would start over),
    so a cancelled row once stayed until the run's end; now the run drops it at the next step
    (no restart, no end) and the other row's tokens are those it gets alone."""
    model, tok = loaded(fixture_dir, "safety_gemma", dg_fx.build)
    settings = dict(max_tokens=2 * dg_fx.CANVAS_LENGTH, max_denoising_steps=12, seed=5)
    alone = Scheduler(model, tok)
    single = alone.submit(Job(PROMPTS[1], dict(settings)))
    while alone.step():
        pass
    scheduler = Scheduler(model, tok)
    gone = scheduler.submit(job_gone_after_looks(PROMPTS[0], dict(settings), looks=4))
    stays = scheduler.submit(Job(PROMPTS[1], dict(settings)))
    with Rows(model, pytest.MonkeyPatch()) as rows:
        while scheduler.step():
            pass
    assert gone.done and stays.done and gone.tokens == []
    assert scheduler.rows_dropped == 1 and scheduler.cut_short == 0
    assert stays.tokens == single.tokens and stays.tokens
    assert rows.sizes[:2] == [2, 2] and set(rows.sizes[4:]) == {1}, rows.sizes
