"""Structured output through `mlx_dllm serve` (issue #31): OpenAI's `response_format` (json_object,
json_schema) with the official `openai` client, streamed and not, on the embedded default model;
rows with different constraints joining a running batch each get their single call's tokens."""

import json
import re
import threading

import jsonschema
import openai
import pytest
from openai import OpenAI

from fixtures import build_once
from fixtures.llada import build_llada
from fixtures.sdar import build_sdar
from helpers import single_call as single
from helpers import step_to_the_end, submit_while_running
from mlx_dllm_models import load
from mlx_dllm_models.default import chat_prompt, default_checkpoint
from mlx_dllm_models.server import make_server, shutdown
from mlx_dllm_models.server.scheduler import Job, Scheduler

MODEL_ID = "default"
QUESTION = "What is 47+85?"
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
}


@pytest.fixture(scope="module")
def default():
    return load(default_checkpoint())


@pytest.fixture(scope="module")
def client():
    server = make_server(
        lambda: load(default_checkpoint()), host="127.0.0.1", port=0, model_id=MODEL_ID
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    shutdown(server)


def ask(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": QUESTION}], **kwargs
    )


@pytest.mark.slow
def test_response_format_json_schema(default, client):
    model, tok = default
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": ANSWER}}
    out = ask(client, response_format=fmt, max_tokens=24, temperature=0)
    content = out.choices[0].message.content
    jsonschema.validate(json.loads(content), ANSWER)
    want = single(model, tok, chat_prompt(tok, QUESTION), json_schema=ANSWER, max_tokens=24)[1]
    assert content == want
    assert out.choices[0].finish_reason == "stop"
    stream = ask(client, response_format=fmt, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_response_format_json_object(client):
    out = ask(client, response_format={"type": "json_object"}, max_tokens=16)
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_as_a_field_of_its_own(client):
    out = client.completions.create(
        model=MODEL_ID, prompt="12+34=", max_tokens=8, extra_body={"regex": "[0-9]{2,3}"}
    )
    assert re.fullmatch("[0-9]{2,3}", out.choices[0].text)


@pytest.mark.parametrize(
    "fmt, message",
    [
        ({"type": "xml"}, "response_format type 'xml' is not supported"),
        ({"type": "json_schema", "json_schema": {"schema": 3}}, "schema an object"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
            "json_schema of prompt 0 cannot be compiled",
        ),
    ],
)
def test_bad_response_formats_are_400s(client, fmt, message):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, response_format=fmt, max_tokens=8)
    assert message in e.value.message


@pytest.mark.parametrize("build, block", [(build_llada, 8), (build_sdar, 4)])
def test_constrained_rows_joining_a_running_batch_get_their_single_calls(fixture_dir, build, block):
    """Requests arrive one block apart with different constraints (and one without); each joins
    the run in progress, where a restarted row's matcher continues after its returned tokens."""
    path = build_once(fixture_dir / f"server_{build.__name__}", build)
    model, tok = load(path)
    scheduler = Scheduler(model, tok, max_batch=4)
    prompts = ["hello world", "a longer prompt", "x", "tell me"]
    constraints = [
        dict(regex="[a-z ]{5,20}"),
        dict(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}}),
        {},
        dict(regex="(yes|no|maybe)"),
    ]
    settings = [dict(max_tokens=4 * block, block_length=block, **c) for c in constraints]
    jobs = submit_while_running(scheduler, [Job(p, dict(s)) for p, s in zip(prompts, settings)])
    step_to_the_end(scheduler)
    assert scheduler.joins >= 1 and scheduler.max_rows >= 2
    for job, prompt, s in zip(jobs, prompts, settings):
        assert job.tokens == single(model, tok, prompt, **s)[0], (prompt, s)
    assert re.fullmatch("[a-z ]{5,20}", tok.decode(jobs[0].tokens))
    assert json.loads(tok.decode(jobs[1].tokens)) in ({}, {"ok": True}, {"ok": False})
    assert tok.decode(jobs[3].tokens) in ("yes", "no", "maybe")


def test_self_speculation_requests_with_constraints(fixture_dir):
    """Nemotron's self-speculation through the scheduler: each request's constraint reaches its
    row (the rows share each forward)."""
    from fixtures import nemotron

    model, tok = load(nemotron.shared_checkpoint(fixture_dir))
    scheduler = Scheduler(model, tok, max_batch=4)
    cases = [("hello", dict(regex="[a-z]{2,6}")), ("x y", dict(regex="(yes|no)")), ("z", {})]
    jobs = [scheduler.submit(Job(p, dict(mode="self_spec", max_tokens=16, **c))) for p, c in cases]
    steps = 0
    while scheduler.step():
        steps += 1
        assert steps < 200
    for job, (prompt, c) in zip(jobs, cases):
        assert job.tokens == single(model, tok, prompt, mode="self_spec", max_tokens=16, **c)[0]
    assert re.fullmatch("[a-z]{2,6}", tok.decode(jobs[0].tokens))
    assert tok.decode(jobs[1].tokens) in ("yes", "no")
