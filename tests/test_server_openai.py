"""`mlx_dllm serve` as OpenAI's clients meet it (issue #26, points 1 and 2), on loopback with the
official `openai` client: seeds (fresh noise without one, reproducible with one, the --seed flag as
the default), fields clients send that change nothing, DiffusionGemma's temperature and top_p,
max_tokens past the context, error bodies, GET /v1/models/{id}, the usage chunk, completion_tokens
under a stop string, SSE keep-alive comments and the access log."""

import json
import logging
import socket
import time

import openai
import pytest

from fixtures import diffusion_gemma as dgfx
from fixtures.llada import build_llada
from fixtures.sdar import build_sdar
from helpers import single_call as single
from mlx_dllm_models import load
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.server import shutdown
from mlx_dllm_models.settings import resolve_settings
from server_checks import chat_prompt, connect, post, start

MODEL_ID = "llada-openai"
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def llada_path(fixture_dir):
    path = fixture_dir / "server_openai_llada"
    if not (path / "config.json").exists():
        build_llada(path)
    return path


@pytest.fixture(scope="module")
def llada(llada_path):
    return load(llada_path)


@pytest.fixture(scope="module")
def served(llada_path):
    server, url = start(llada_path, MODEL_ID)
    yield server, url
    shutdown(server)


@pytest.fixture
def client(served):
    return connect(served[1])


def chat_text(client, **kwargs):
    out = client.chat.completions.create(model=MODEL_ID, messages=CHAT, **kwargs)
    return out.choices[0].message.content


# ------------------------------------------------------------------------- 1. what clients send


@pytest.mark.slow
def test_no_seed_draws_fresh_noise_and_a_seed_reproduces(llada, client):
    settings = dict(max_tokens=16, temperature=1.0, extra_body={"block_length": 8})
    texts = [chat_text(client, **settings) for _ in range(5)]
    assert len(set(texts)) > 1, "five requests without a seed gave one text"
    seeded = [chat_text(client, seed=7, **settings) for _ in range(2)]
    model, tokenizer = llada
    prompt = chat_prompt(tokenizer, CHAT[0]["content"])
    ref = single(model, tokenizer, prompt, max_tokens=16, block_length=8, temperature=1.0, seed=7)
    assert seeded == [ref[1]] * 2


def test_the_seed_flag_is_the_servers_default(llada, llada_path):
    server, url = start(llada_path, MODEL_ID, defaults={"seed": 3})
    try:
        client = connect(url)
        texts = [chat_text(client, max_tokens=16, temperature=1.0) for _ in range(2)]
    finally:
        shutdown(server)
    model, tokenizer = llada
    prompt = chat_prompt(tokenizer, CHAT[0]["content"])
    assert (
        texts == [single(model, tokenizer, prompt, max_tokens=16, temperature=1.0, seed=3)[1]] * 2
    )


def test_fields_that_change_nothing_are_accepted_and_ignored(llada, client):
    model, tokenizer = llada
    want = single(model, tokenizer, chat_prompt(tokenizer, CHAT[0]["content"]), max_tokens=16)[1]
    harmless = dict(
        response_format={"type": "text"},
        store=False,
        metadata={"app": "test"},
        user="someone",
        service_tier="auto",
        reasoning_effort="low",
        parallel_tool_calls=False,
        tool_choice="none",
        n=1,
        presence_penalty=0,
        frequency_penalty=0.0,
        temperature=0,
        top_p=1,  # filters nothing; at temperature 0 the settings table refuses other values
    )
    assert chat_text(client, max_tokens=16, **harmless) == want
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=CHAT,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": False},
        **harmless,
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


@pytest.mark.parametrize(
    "field, value",
    [
        ("tool_choice", "required"),
        ("presence_penalty", 0.5),
        ("logit_bias", {"5": 10}),
        ("min_p", 0.1),
    ],
)
def test_fields_that_would_change_the_output_are_refused(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        chat_text(client, max_tokens=8, extra_body={field: value})
    assert f"{field} is not supported" in e.value.message
    assert e.value.param == field and e.value.type == "invalid_request_error"


def test_max_tokens_past_the_context_is_capped(fixture_dir):
    path = fixture_dir / "server_openai_llada_64"  # the fixture with a 64-position context
    if not (path / "config.json").exists():
        build_llada(path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(dict(config, max_sequence_length=64)))
    model, tokenizer = load(path)
    prompt = [65] * 56  # leaves 8 positions
    settings = dict(block_length=8, logits_eos_inf=True)  # no EOS: the cap ends the answer
    server, url = start(path, MODEL_ID)
    try:
        client = connect(url)
        out = client.completions.create(
            model=MODEL_ID, prompt=prompt, max_tokens=5000, extra_body=settings
        )
        with pytest.raises(openai.BadRequestError, match="fills the model's context"):
            client.completions.create(model=MODEL_ID, prompt=[65] * 64, max_tokens=8)
    finally:
        shutdown(server)
    tokens, text, _ = single(model, tokenizer, prompt, max_tokens=8, **settings)
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(tokens) == 8
    assert out.usage.prompt_tokens == len(prompt)


# ---------------------------------------------------------------------------- DiffusionGemma


@pytest.fixture(scope="module")
def gemma(fixture_dir):
    path = fixture_dir / "server_openai_diffusion_gemma"
    if not (path / "config.json").exists():
        dgfx.CHECKPOINTS["diffusion_gemma"](path)
    model, processor = load(path)
    server, url = start(path, "gemma")
    yield model, processor, connect(url)
    shutdown(server)


DG = dict(max_tokens=dgfx.CANVAS_LENGTH, max_denoising_steps=4)


@pytest.mark.slow
def test_diffusion_gemma_temperature_scales_its_schedule(gemma):
    model, processor, client = gemma
    spec = model.diffusion_spec
    schedule = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    prompt = chat_prompt(processor, "hi")

    def ask(**kwargs):
        out = client.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=DG["max_tokens"],
            extra_body={"max_denoising_steps": 4},
            **kwargs,
        )
        return out.choices[0].message.content

    for t in (1.0, 0.5):
        scaled = dict(t_min=schedule.t_min * t, t_max=schedule.t_max * t)
        want = single(model, processor, prompt, seed=5, **scaled, **DG)[1]
        assert ask(temperature=t, top_p=1, seed=5) == want, t
    assert ask(seed=5) == ask(temperature=1, seed=5)
    texts = {ask() for _ in range(3)}  # no seed: fresh noise
    assert len(texts) > 1
    with pytest.raises(openai.BadRequestError, match="top_p=0.9 cannot be honoured") as e:
        ask(top_p=0.9)
    assert e.value.param == "top_p"
    # 0 is greedy denoising from the seed's noise canvas (tests/test_setting_surfaces.py).
    assert (
        ask(temperature=0, seed=5)
        == single(model, processor, prompt, seed=5, temperature=0, **DG)[1]
    )


# ------------------------------------------------------------------------- 2. OpenAI's shapes


def test_errors_carry_openais_error_object(served, client):
    _, url = served
    with pytest.raises(openai.BadRequestError) as e:
        chat_text(client, max_tokens=8, extra_body={"steps": 0})
    assert "steps must be" in e.value.message
    assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert "not served here" in e.value.message and e.value.code == "model_not_found"
    for path, raw, status in [
        ("/v1/chat/completions", b'{"messages": [', 400),
        ("/v1/chat/completions", b"[1, 2]", 400),
        ("/v1/nowhere", b"{}", 404),
    ]:
        code, text = post(url, path, None, raw)
        error = json.loads(text)["error"]
        assert code == status and error["type"] == "invalid_request_error", text
        assert error["message"] and set(error) == {"message", "type", "param", "code"}


def test_models_list_and_retrieve(served, client):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"


def sse(url, path, body):
    """(comments, data packets) of a streamed answer, in order, as the server wrote them."""
    code, text = post(url, path, dict(body, stream=True))
    assert code == 200, text
    events = [e for e in text.split("\n\n") if e]
    data = [e[len("data: ") :] for e in events if e.startswith("data: ")]
    return [e for e in events if e.startswith(":")], data


def test_usage_chunk_and_cached_tokens(served, client):
    _, url = served
    for path, body, kind in [
        ("/v1/chat/completions", {"messages": CHAT}, "chat.completion.chunk"),
        ("/v1/completions", {"prompt": "Once upon"}, "text_completion"),
    ]:
        body = dict(body, max_tokens=12, stream_options={"include_usage": True})
        _, data = sse(url, path, body)
        assert data[-1] == "[DONE]"
        usage = json.loads(data[-2])
        assert usage["object"] == kind and usage["choices"] == []
        assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert all(json.loads(d)["object"] == kind for d in data[:-1])
    out = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # full recompute caches nothing


def test_cached_tokens_report_the_prompt_cache(fixture_dir):
    """A conversation resent turn by turn to a block-causal model: the prompt cache's count."""
    path = fixture_dir / "server_openai_sdar"
    if not (path / "config.json").exists():
        build_sdar(path)
    server, url = start(path, "sdar")
    try:
        client, messages, cached = connect(url), [], []
        for query, stream in [("hello", False), ("and more?", False), ("ok", True)]:
            messages.append({"role": "user", "content": query})
            kwargs = dict(model="sdar", messages=messages, max_tokens=8, stream=stream)
            extra = {"block_length": 4, "steps": 4}
            if stream:
                kwargs["stream_options"] = {"include_usage": True}
                chunks = list(client.chat.completions.create(**kwargs, extra_body=extra))
                reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                out = client.chat.completions.create(**kwargs, extra_body=extra)
                reply, usage = out.choices[0].message.content, out.usage
            messages.append({"role": "assistant", "content": reply})
            cached.append(usage.prompt_tokens_details.cached_tokens)
    finally:
        shutdown(server)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached


def test_completion_tokens_count_the_tokens_a_stop_string_leaves(llada, client):
    model, tokenizer = llada
    tokens, text, _ = single(model, tokenizer, "The sky", max_tokens=24, block_length=24)
    assert len(text) > 14
    word = text[10:14]  # one block: without the cut, all 24 tokens would be counted
    out = client.completions.create(
        model=MODEL_ID,
        prompt="The sky",
        max_tokens=24,
        stop=[word],
        extra_body={"block_length": 24},
    )
    returned = out.choices[0].text
    assert returned == text[: text.index(word)] and out.choices[0].finish_reason == "stop"
    n = out.usage.completion_tokens
    assert 0 < n < len(tokens)
    # The fewest tokens whose text holds the returned text.
    assert (
        len(tokenizer.decode(tokens[:n])) >= len(returned) > len(tokenizer.decode(tokens[: n - 1]))
    )


def test_streams_send_keep_alive_comments_while_they_wait(llada, served, client, monkeypatch):
    server, url = served
    model, tokenizer = llada
    settings = dict(max_tokens=8, block_length=8, steps=2)
    want = single(model, tokenizer, "Once upon a time", **settings)[1]
    real = type(model).__call__

    def slow(self, *args, **kwargs):  # a forward as slow as a long prompt's
        time.sleep(0.3)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", slow)
    monkeypatch.setattr(server.service, "keepalive", 0.1)
    comments, data = sse(url, "/v1/completions", dict(settings, prompt="Once upon a time"))
    stream = client.completions.create(
        model=MODEL_ID,
        prompt="Once upon a time",
        max_tokens=8,
        stream=True,
        extra_body={"block_length": 8, "steps": 2},
    )
    text = "".join(c.choices[0].text for c in stream)
    assert comments and set(comments) == {": keep-alive"}
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == want
    assert text == want, "the client reads through the comments"


def test_one_access_log_line_per_request(served, client, caplog):
    server, url = served
    caplog.set_level(logging.INFO, logger="mlx_dllm_models.server.api")
    out = client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=4)
    code, _ = post(url, "/v1/completions", {"prompt": "hi", "steps": 0})
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        while sock.recv(4096):
            pass
    deadline = time.time() + 10
    while len(caplog.records) < 3 and time.time() < deadline:
        time.sleep(0.02)
    lines = sorted(r.getMessage() for r in caplog.records if r.name == "mlx_dllm_models.server.api")
    assert len(lines) == 3, lines  # answered before they are logged: in any order
    usage = out.usage
    assert lines[0].startswith("GET /health 200 "), lines
    assert lines[1].startswith("POST /v1/completions 200 "), lines
    assert (
        f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
        in lines[1]
    )
    assert lines[2].startswith("POST /v1/completions 400 prompt_tokens=- completion_tokens=- ")
    assert all(line.endswith("s") and float(line.split()[-1][:-1]) >= 0 for line in lines)
