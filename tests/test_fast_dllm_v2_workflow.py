"""Fast-dLLM v2 through the package's workflows: plain `python -m mlx_lm convert` and `mlx_lm.load`
in a fresh process, an earlier run's K/V reused (chat turns), sharding (one rank in process; two
ranks of mlx.launch's ring backend: tests/test_sharded_families.py), and `serve`: one completion, and rows joining a running batch
with the tokens of single calls."""

from pathlib import Path

import numpy as np
import pytest

from fixtures import fast_dllm_v2 as fx
from helpers import (
    checkpoint_fixtures,
    load_fixture,
    single_call,
    step_to_the_end,
    submit_while_running,
)
from mlx_dllm_models import load
from mlx_dllm_models.engine import BlockEvent
from mlx_dllm_models.generate import stream_events

WORKER = Path(__file__).with_name("distributed_worker.py")


checkpoint, loaded = checkpoint_fixtures(
    "fast_dllm_v2", fx.build, name="checkpoint", loader=load_fixture
)


def prompt(n):
    return np.random.default_rng(n).integers(0, 256, n).tolist()


def _tokens(decoder, ids, **kw):
    out = []
    for event in decoder.run(ids, **kw):
        if isinstance(event, BlockEvent):
            out.extend(event.tokens[0])
    return out


@pytest.mark.parametrize("first_length, length", [(45, 64), (45, 75), (64, 128)])
def test_a_later_prompt_reuses_an_earlier_runs_kv_exactly(loaded, first_length, length):
    """A chat's next turn: the prompt continues the first run's tokens (or repeats part of them).
    A prompt that ends on a block edge (64, 128) seeds its first block from the prefill's last
    logit, so the last block of the shared prefix is computed again even where the earlier run
    holds its K/V (128: all of them)."""
    model, tok = loaded
    first = prompt(first_length)
    _, ids, decoder = stream_events(model, tok, [first], max_tokens=80)
    answer = _tokens(decoder, ids)
    prior = decoder.kv_prefix()
    assert prior is not None
    follow = (first + answer + prompt(200))[:length]
    if length == 128:
        assert len(prior.tokens) >= length  # the earlier run's K/V cover the whole prompt
    _, ids, fresh = stream_events(model, tok, [follow], max_tokens=40)
    _, _, reusing = stream_events(model, tok, [follow], max_tokens=40)
    assert _tokens(reusing, ids, prior=prior) == _tokens(fresh, ids)
    assert reusing.backend.reused > 0


@pytest.mark.slow
def test_rows_joining_a_running_batch_get_the_tokens_of_single_calls(loaded, checkpoint):
    """Requests arrive one block apart and join the batch at block boundaries (a restart over
    [prompt ; committed], whose seeded blocks must come out as in the run)."""
    from mlx_dllm_models.server import Job, Scheduler

    model, tok = loaded
    scheduler = Scheduler(load(checkpoint)[0], tok, max_batch=4)
    prompts = ["hello world", "a longer prompt than that", "x", "tell me more please"]
    budgets = [96, 70, 64, 40]
    jobs = submit_while_running(
        scheduler, [Job(t, {"max_tokens": n}) for t, n in zip(prompts, budgets)]
    )
    step_to_the_end(scheduler, 500)
    assert scheduler.joins >= 1 and all(j.done for j in jobs)
    for i, (job, text, n) in enumerate(zip(jobs, prompts, budgets)):
        tokens = single_call(model, tok, text, max_tokens=n)[0]
        assert job.tokens == tokens, f"request {i}"
