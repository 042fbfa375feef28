"""Fast-dLLM v2 through the package's workflows: plain `python -m mlx_lm convert` and `mlx_lm.load`
in a fresh process, an earlier run's K/V reused (chat turns), sharding (one rank in process; two
ranks of mlx.launch's ring backend: tests/test_sharded_families.py), and `serve`: one completion, and rows joining a running batch
with the tokens of single calls."""

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures import fast_dllm_v2 as fx
from helpers import (
    convert_and_generate,
    load_fixture,
)
from mlx_dllm_models import SettingsError, batch_generate_diffusion, load
from mlx_dllm_models.engine import BlockEvent
from mlx_dllm_models.generate import stream_events

WORKER = Path(__file__).with_name("distributed_worker.py")


@pytest.fixture(scope="module")
def checkpoint(fixture_dir):
    return build_once(fixture_dir / "fast_dllm_v2", fx.build)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_fixture(checkpoint)


def prompt(n):
    return np.random.default_rng(n).integers(0, 256, n).tolist()


def test_plain_mlx_lm_convert_and_load(loaded, checkpoint, tmp_path):
    model, tok = loaded
    got = convert_and_generate(checkpoint, tmp_path / "mlx", [list(range(40, 85))], max_tokens=40)
    cfg = got["config"]
    assert cfg["model_type"] == "Fast_dLLM_Qwen" and "auto_map" not in cfg
    assert cfg["bd_size"] == fx.BLOCK_SIZE
    assert got["module"] == "mlx_dllm_models.models.fast_dllm_qwen"
    want = batch_generate_diffusion(model, tok, [list(range(40, 85))], max_tokens=40)
    assert got["tokens"][0] == want.tokens[0] and len(want.tokens[0]) > 0


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


class _Ranks:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n

    def rank(self):
        return 0


def test_shard_over_one_rank_keeps_logits_and_three_ranks_are_refused(checkpoint):
    model, _ = load_fixture(checkpoint)
    ids = mx.array([prompt(7) + [fx.MASK] * 5])
    before = np.array(model(ids))
    model.shard(mx.distributed.init())
    np.testing.assert_allclose(np.array(model(ids)), before, rtol=1e-5, atol=1e-5)
    with pytest.raises(SettingsError, match="cannot split the checkpoint over 3 ranks"):
        load_fixture(checkpoint)[0].shard(_Ranks(3))


def _single(model, tok, text, **settings):
    from mlx_dllm_models import stream_generate_diffusion

    tokens, out = [], ""
    for r in stream_generate_diffusion(model, tok, text, **settings):
        tokens += r.tokens
        out += r.text
    return tokens, out


def test_one_completion_request_through_serve(loaded, checkpoint):
    from openai import OpenAI

    from mlx_dllm_models.server import make_server, shutdown

    model, tok = loaded
    server = make_server(lambda: load(checkpoint), host="127.0.0.1", port=0, model_id="fdllm")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x")
        text = "Question: what is a block?\nAnswer:"
        answer = client.completions.create(model="fdllm", prompt=text, max_tokens=40, temperature=0)
        _, want = _single(model, tok, text, max_tokens=40, temperature=0)
        assert answer.choices[0].text == want and len(want) > 0
    finally:
        shutdown(server)


def test_rows_joining_a_running_batch_get_the_tokens_of_single_calls(loaded, checkpoint):
    """Requests arrive one block apart and join the batch at block boundaries (a restart over
    [prompt ; committed], whose seeded blocks must come out as in the run)."""
    from mlx_dllm_models.server import Job, Scheduler

    model, tok = loaded
    scheduler = Scheduler(load(checkpoint)[0], tok, max_batch=4)
    prompts = ["hello world", "a longer prompt than that", "x", "tell me more please"]
    budgets = [96, 70, 64, 40]
    jobs = []
    for text, n in zip(prompts, budgets):
        jobs.append(scheduler.submit(Job(text, {"max_tokens": n})))
        scheduler.step()
    steps = 0
    while scheduler.step():
        steps += 1
        assert steps < 500
    assert scheduler.joins >= 1 and all(j.done for j in jobs)
    for i, (job, text, n) in enumerate(zip(jobs, prompts, budgets)):
        tokens, _ = _single(model, tok, text, max_tokens=n)
        assert job.tokens == tokens, f"request {i}"
