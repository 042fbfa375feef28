"""`mlx_dllm serve`'s HTTP side on Starlette + uvicorn (issue #40), over real HTTP on loopback with
the embedded default model: OpenAI errors for every method and path (and a garbage request line),
the API key, /health and /metrics, client chat templates (refused unless allowed, then within a
budget), template arguments the server passes itself, image limits read from the header, and what
OpenAI's clients tripped over (top_logprobs -1, echo / best_of / suffix, `param` of field errors,
an empty answer's content, tool and unknown roles, null content, a million-id prompt)."""

import json
import socket
import threading
import time

import openai
import pytest
from openai import OpenAI

from fixtures import build_once
from fixtures import diffusion_gemma as dgfx
from mlx_dllm_models import load
from mlx_dllm_models.default import default_checkpoint
from mlx_dllm_models.server import make_server, shutdown
from mlx_dllm_models.server.fields import RequestError
from mlx_dllm_models.server.images import ImagePolicy, PixelBudget, read_image
from mlx_dllm_models.server.process import check_args
from mlx_dllm_models.server.process import parser as serve_parser
from mlx_dllm_models.server.templates import CLIENT_TEMPLATE_SECONDS
from mlx_dllm_models.vision import text_tokenizer
from server_checks import call, data_url, grey_png

MODEL_ID = "default"
CHAT = {"messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 8}


def start(load_model=None, **kwargs):
    server = make_server(
        load_model or (lambda: load(default_checkpoint())),
        host="127.0.0.1",
        port=0,
        model_id=MODEL_ID,
        **kwargs,
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def error(text) -> dict:
    out = json.loads(text)["error"]
    assert set(out) == {"message", "type", "param", "code"}
    return out


@pytest.fixture(scope="module")
def served():
    server, url = start(allow_client_chat_template=True)
    yield server, url
    shutdown(server)


@pytest.fixture(scope="module")
def strict():
    """The defaults: no client templates."""
    server, url = start()
    yield server, url
    shutdown(server)


# ------------------------------------------------------------------------- methods and paths


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_other_methods_get_a_json_405(served, method):
    _, url = served
    for path, allowed in [("/v1/chat/completions", "POST"), ("/v1/models", "GET")]:
        status, headers, text = call(url, path, {}, method=method)
        assert status == 405 and allowed in headers["Allow"], (method, path)
        message = error(text)["message"]
        assert message.startswith(f"{method} is not allowed on {path}; it takes ")
        assert allowed in message.rsplit("takes ", 1)[1]
    status, _, text = call(url, "/nowhere", {}, method=method)
    assert status == 404 and error(text)["message"] == f"no such endpoint: {method} /nowhere"


def test_head_gets_headers_only(served):
    _, url = served
    status, headers, text = call(url, "/v1/chat/completions", method="HEAD")
    assert status == 405 and headers["Content-Type"] == "application/json" and text == ""
    status, _, text = call(url, "/health", method="HEAD")
    assert status == 200 and text == ""


def raw(url, data: bytes) -> bytes:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    "line",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\r\n\r\n",
    ],
)
def test_a_garbage_request_gets_a_json_400_and_a_close(served, line):
    _, url = served
    answer = raw(url, line)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head
    assert "could not be read as HTTP/1.1" in error(body)["message"]


# ----------------------------------------------------------------------- keys, health, metrics


def test_api_key(monkeypatch):
    monkeypatch.setenv("MLX_DLLM_API_KEY", "from-env")
    args = serve_parser().parse_args([])
    check_args(args)
    assert args.api_keys == ["from-env"]
    args = serve_parser().parse_args(["--api-key", "flag"])
    check_args(args)
    assert args.api_keys == ["flag"]  # the flag over the environment
    server, url = start(api_keys=["sekrit"])
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            status, answer, text = call(url, "/v1/chat/completions", CHAT, headers=headers)
            assert status == 401 and answer["WWW-Authenticate"] == "Bearer"
            assert error(text)["code"] == "invalid_api_key"
            assert call(url, "/v1/models", headers=headers)[0] == 401
        assert call(url, "/health")[0] == 200  # for a load balancer, without the key
        client = OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert client.chat.completions.create(model=MODEL_ID, **CHAT).choices[0].message
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        shutdown(server)


def test_health_and_metrics(served):
    server, url = served
    assert call(url, "/health")[:1] == (200,)
    status, _, _ = call(url, "/v1/chat/completions", CHAT)
    assert status == 200
    status, headers, text = call(url, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['mlx_dllm_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    scheduler = server.service.scheduler
    assert samples["mlx_dllm_forwards_total"] >= 1
    assert samples["mlx_dllm_completion_tokens_total"] >= 1
    assert samples["mlx_dllm_prompt_tokens_total"] >= 1
    assert "mlx_dllm_requests_waiting" in samples and "mlx_dllm_requests_running" in samples
    batches = {k: v for k, v in samples.items() if k.startswith("mlx_dllm_batch_forwards_total")}
    assert batches and sum(batches.values()) <= scheduler.forwards
    # A path a client makes up is counted as "other": the counters stay bounded.
    call(url, "/made/up/path")
    assert 'endpoint="other"' in call(url, "/metrics")[2]
    assert "/made/up" not in call(url, "/metrics")[2]


def test_cors_echo_carries_vary_origin(strict):
    server, _ = strict
    app = "http://localhost:3000"
    other, url = start(lambda: (server.service.model, server.service.tokenizer), cors_origins=[app])
    try:
        status, headers, _ = call(url, "/v1/models", headers={"Origin": app})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == app
        assert "Origin" in headers["Vary"]
    finally:
        shutdown(other)


# ------------------------------------------------------------------------------ chat templates


def test_client_chat_templates_are_refused_by_default(strict):
    _, url = strict
    body = dict(CHAT, chat_template_kwargs={"chat_template": "{{ 7*7 }}"})
    status, _, text = call(url, "/v1/chat/completions", body)
    answer = error(text)
    assert status == 400 and "--allow-client-chat-template" in answer["message"]
    assert answer["param"] == "chat_template_kwargs.chat_template"


@pytest.mark.parametrize("name", ["tokenize", "add_generation_prompt", "messages", "return_dict"])
def test_template_arguments_the_server_passes_are_a_400(strict, name):
    _, url = strict
    status, _, text = call(url, "/v1/chat/completions", dict(CHAT, chat_template_kwargs={name: 1}))
    answer = error(text)
    assert status == 400 and f"may not set {name}" in answer["message"]
    assert answer["param"] == "chat_template_kwargs"
    # A harmless argument reaches the template, as before.
    body = dict(CHAT, chat_template_kwargs={"enable_thinking": False})
    assert call(url, "/v1/chat/completions", body)[0] == 200


def test_an_allowed_client_template_is_used_within_its_budget(served):
    server, url = served
    tok = text_tokenizer(server.service.tokenizer)
    body = dict(CHAT, chat_template_kwargs={"chat_template": "{{ 7*7 }} {{ messages[0].content }}"})
    status, _, text = call(url, "/v1/chat/completions", body)
    assert status == 200, text
    usage = json.loads(text)["usage"]
    assert usage["prompt_tokens"] == len(tok.encode("49 What is 2+3?", add_special_tokens=False))
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = time.perf_counter()
    body = dict(CHAT, chat_template_kwargs={"chat_template": loops})
    status, _, text = call(url, "/v1/chat/completions", body)
    took = time.perf_counter() - started
    assert status == 400 and "ran past its budget" in error(text)["message"]
    assert took < CLIENT_TEMPLATE_SECONDS + 3, took
    wide = "{% for i in range(100000) %}{% for j in range(100000) %}xxxx{% endfor %}{% endfor %}"
    body = dict(CHAT, chat_template_kwargs={"chat_template": wide})
    status, _, text = call(url, "/v1/chat/completions", body)
    assert status == 400 and "more than its budget of" in error(text)["message"]
    body = dict(CHAT, chat_template_kwargs={"chat_template": "{{ raise_exception('no!') }}"})
    status, _, text = call(url, "/v1/chat/completions", body)
    assert status == 400 and error(text)["message"].endswith("refused the messages: no!")


# ------------------------------------------------------------------------------------- images


def test_image_limits_are_read_from_the_header():
    policy = ImagePolicy(max_image_pixels=100 * 100, max_images=2, max_request_pixels=150 * 100)
    budget = PixelBudget(policy)
    assert read_image(data_url(grey_png(100, 100)), policy, budget).shape == (100, 100, 3)
    with pytest.raises(RequestError, match=r"100 x 101 = 10100 pixels.*--max-image-pixels"):
        read_image(data_url(grey_png(100, 101)), policy, budget)
    with pytest.raises(RequestError, match=r"20000 pixels in all.*--max-request-pixels"):
        read_image(data_url(grey_png(100, 100)), policy, budget)
    with pytest.raises(RequestError, match=r"3 images.*\(2; the server's --max-images-per"):
        budget.count(3)
    # The default: a 12000 x 12000 image is refused from its header, before any pixel.
    started = time.perf_counter()
    with pytest.raises(RequestError, match="--max-image-pixels"):
        read_image(data_url(grey_png(12000, 12000)))
    assert time.perf_counter() - started < 5


@pytest.fixture(scope="module")
def gemma(fixture_dir):
    path = build_once(fixture_dir / "http_gemma", dgfx.CHECKPOINTS["diffusion_gemma"])
    policy = ImagePolicy(max_images=2, max_request_pixels=2 * 16 * 16 + 1)
    server, url = start(lambda: load(path), image_policy=policy)
    yield url
    shutdown(server)


def ask_images(url, *pngs):
    content = [{"type": "text", "text": "hi"}]
    content += [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs]
    body = {"messages": [{"role": "user", "content": content}], "seed": 0}
    body.update(max_tokens=dgfx.CANVAS_LENGTH, max_denoising_steps=2)
    status, _, text = call(url, "/v1/chat/completions", body)
    return status, json.loads(text)


def test_image_limits_over_http(gemma):
    small = grey_png(dgfx.IMAGE_SIZE, dgfx.IMAGE_SIZE)
    assert ask_images(gemma, small, small)[0] == 200
    for pngs, flag in [
        ((small, small, small), "--max-images-per-request"),
        ((small, grey_png(16, 17)), "--max-request-pixels"),
        ((grey_png(12000, 12000),), "--max-image-pixels"),
    ]:
        status, answer = ask_images(gemma, *pngs)
        assert status == 400 and flag in answer["error"]["message"], answer


# --------------------------------------------------------------------- what clients tripped over


@pytest.fixture(scope="module")
def client(strict):
    return OpenAI(base_url=strict[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_top_logprobs_minus_one_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, logprobs=True, top_logprobs=-1, **CHAT)
    assert "top_logprobs must be an integer from 0 to 20" in e.value.message
    assert e.value.param == "top_logprobs"


@pytest.mark.parametrize("field, value", [("echo", True), ("best_of", 2), ("suffix", "x")])
def test_completion_fields_of_openai_are_described_as_such(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=4, **{field: value})
    assert f"{field} is not supported: " in e.value.message
    assert "family" not in e.value.message and e.value.param == field
    # Their neutral values ask for nothing.
    out = client.completions.create(
        model=MODEL_ID, prompt="hi", max_tokens=4, echo=False, best_of=1
    )
    assert out.choices[0].text is not None


@pytest.mark.parametrize(
    "field, value", [("max_tokens", -1), ("temperature", -1), ("top_p", 2), ("steps", 0)]
)
def test_field_errors_name_their_param(strict, field, value):
    _, url = strict
    body = dict(CHAT, **{field: value})
    if field == "top_p":
        body["temperature"] = 1
    status, _, text = call(url, "/v1/chat/completions", body)
    answer = error(text)
    assert status == 400 and answer["param"] == field, answer


def test_an_empty_answer_is_an_empty_string(client):
    first = client.chat.completions.create(model=MODEL_ID, **CHAT).choices[0].message.content
    assert first
    out = client.chat.completions.create(model=MODEL_ID, stop=[first[0]], **CHAT)
    assert out.choices[0].message.content == "" and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "message, param, words",
    [
        ({"role": "hacker", "content": "hi"}, "messages[0].role", "not a chat role"),
        ({"role": "tool", "content": "hi"}, "messages[0].role", "tool messages"),
        ({"role": "user", "content": None}, "messages[0].content", "needs a content"),
    ],
)
def test_roles_and_null_content_are_a_400(strict, message, param, words):
    _, url = strict
    status, _, text = call(url, "/v1/chat/completions", {"messages": [message], "max_tokens": 4})
    answer = error(text)
    assert status == 400 and answer["param"] == param and words in answer["message"]


def test_a_million_id_prompt_is_refused_fast(strict):
    _, url = strict
    started = time.perf_counter()
    status, _, text = call(url, "/v1/completions", {"prompt": [65] * 1_000_000, "max_tokens": 4})
    took = time.perf_counter() - started
    assert status == 400 and "1000000 token ids, more than the model's context" in text
    assert took < 3, took


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "stop": [1]}, "stop"),
        ({"prompt": "hi", "stream_options": 3}, "stream_options"),
        ({"prompt": {"text": "hi"}}, "prompt"),
    ],
)
def test_the_bodys_own_fields_are_typed(strict, body, param):
    _, url = strict
    status, _, text = call(url, "/v1/completions", body)
    answer = error(text)
    assert status == 400 and answer["param"] == param and answer["message"].startswith(param)


def test_all_of_two_object_schemas_is_satisfiable(client):
    import jsonschema

    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    out = client.chat.completions.create(
        model=MODEL_ID,
        messages=CHAT["messages"],
        max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "ab", "schema": schema}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_a_bad_pattern_gets_the_whole_message(client):
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": "(("}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_ID,
            messages=CHAT["messages"],
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
    assert "regex parse error: (( ^ error: unclosed group" in e.value.message


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-image-pixels", "0"], "--max-image-pixels must be at least 1"),
        (["--max-images-per-request", "0"], "--max-images-per-request must be at least 1"),
        (["--max-request-pixels", "-5"], "--max-request-pixels must be at least 1"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
        (["--header-timeout", "0"], "--header-timeout must be more than 0 seconds"),
        (["--body-timeout", "-1"], "--body-timeout must be more than 0 seconds"),
        (["--idle-timeout", "0"], "--idle-timeout must be more than 0 seconds"),
    ],
)
def test_the_new_flags_out_of_range_are_one_line_errors(flags, message):
    args = serve_parser().parse_args(flags)
    with pytest.raises(SystemExit) as e:
        check_args(args)
    text = str(e.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text


def test_client_templates_render_a_few_at_a_time(monkeypatch):
    from mlx_dllm_models.server import templates

    monkeypatch.setattr(templates, "RENDERS", threading.BoundedSemaphore(1))
    monkeypatch.setattr(templates, "RENDER_WAIT_SECONDS", 0.1)
    assert templates.render_client_template("{{ 6*7 }}", [], {}, {}) == "42"
    templates.RENDERS.acquire()  # one render running
    try:
        with pytest.raises(RequestError, match="being rendered") as e:
            templates.render_client_template("{{ 6*7 }}", [], {}, {})
        assert e.value.status == 429
    finally:
        templates.RENDERS.release()
