"""What `mlx_dllm serve` does with a request it cannot take (issue #27 §2), over real HTTP on
loopback: a body over --max-body-bytes is a 413 and a prompt that cannot fit in the context a 400
before it is tokenized; a bad body (invalid UTF-8, no role, deep nesting, a template that raises)
gets an OpenAI error and one short log line, and so does a bug (a 500)."""

import json
import logging
import re
import time
import uuid

import pytest

from mlx_dllm_models.server import shutdown
from mlx_dllm_models.server.api import Service
from mlx_dllm_models.vision import text_tokenizer
from server_checks import CHAT, call, error_of, llada_served, start

llada_path, served = llada_served()


# ---------------------------------------------------------------------------- request bodies


def test_a_50_mb_body_is_refused_at_once_with_a_413(served):
    server, url = served
    assert server.service.max_body_bytes == 32 * 1024 * 1024  # the default
    body = json.dumps({"prompt": "x" * (50 * 1024 * 1024)}).encode()
    started = time.perf_counter()
    status, _, text = call(url, "/v1/completions", raw=body)
    took = time.perf_counter() - started
    assert status == 413 and "--max-body-bytes" in error_of(text)
    assert took < 10, took  # the body is read in chunks and dropped, not parsed nor tokenized
    print(f"50 MB body: 413 in {took * 1000:.0f} ms")
    status, _, _ = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 200


def test_max_body_bytes_is_the_bound(llada_path):
    server, url = start(llada_path, max_body_bytes=2048)
    try:
        status, _, text = call(url, "/v1/completions", {"prompt": "y" * 3000, "max_tokens": 4})
        assert status == 413 and "more than this server takes (2048)" in error_of(text)
        status, _, _ = call(url, "/v1/completions", {"prompt": "y" * 100, "max_tokens": 4})
        assert status == 200
    finally:
        shutdown(server)


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(
    served, monkeypatch
):
    server, url = served
    service = server.service
    bound = service.context * service.token_chars
    encoded = []
    real = Service.prepare

    def watched(self, prompt, overrides, images=None):
        encoded.append(len(prompt))
        return real(self, prompt, overrides, images)

    # 20 MB: under the body bound, far over what 4096 positions hold.
    started = time.perf_counter()
    status, _, text = call(url, "/v1/completions", {"prompt": "z" * 20_000_000})
    took = time.perf_counter() - started
    assert status == 400
    assert f"more than the model's context of {service.context} tokens" in error_of(text)
    assert took < 10, took
    print(f"20 MB prompt: 400 in {took * 1000:.0f} ms (bound {bound} characters)")
    # Just under the bound, the tokenizer decides (and the context check refuses it).
    monkeypatch.setattr(Service, "prepare", watched)
    status, _, text = call(url, "/v1/completions", {"prompt": "z" * (bound - 10)})
    assert status == 400 and "fills the model's context" in error_of(text)
    assert encoded == [bound - 10]


def request_lines(caplog, marker: str):
    """The package's log lines of the request whose path holds `marker` (its access line is
    written once the answer was sent, so it may come just after the client read the answer), and
    every ERROR line."""
    deadline = time.time() + 5
    while True:
        lines = [r for r in caplog.records if r.name.startswith("mlx_dllm_models")]
        mine = [r.getMessage() for r in lines if marker in r.getMessage()]
        if mine or time.time() > deadline:
            return mine + [r.getMessage() for r in lines if r.levelno >= logging.ERROR]
        time.sleep(0.01)


def raw_post(url, path, data: bytes):
    return call(url, path, raw=data)


@pytest.mark.parametrize(
    "data, status, message",
    [
        (b'{"prompt": "caf\xe9"}', 400, r"not UTF-8 text \(byte 0xe9 at offset 15\)"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nests objects and lists more than 64 deep"),
        (json.dumps({"messages": [{"content": "hi"}]}).encode(), 400, r"messages\[0\] has no role"),
        (
            json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(),
            400,
            r"messages\[0\].content must be a string",
        ),
        (json.dumps([1, 2]).encode(), 400, "JSON dictionary"),
    ],
)
def test_bad_bodies_get_an_error_and_one_short_log_line(
    served, caplog, capfd, data, status, message
):
    _, url = served
    path = "/v1/completions" if b'"prompt"' in data else "/v1/chat/completions"
    marker = f"case={uuid.uuid4().hex}"
    with caplog.at_level(logging.INFO):
        code, _, text = raw_post(url, f"{path}?{marker}", data)
        lines = request_lines(caplog, marker)
    assert code == status and re.search(message, error_of(text)), text
    assert len(lines) == 1 and f" {status} " in lines[0]
    assert "Traceback" not in capfd.readouterr().err


def test_a_huge_bad_body_is_not_logged(served, caplog, capfd):
    _, url = served
    part = {"type": "video", "data": "v" * 5_000_000}
    body = {"messages": [{"role": "user", "content": [part]}]}
    with caplog.at_level(logging.DEBUG, logger="mlx_dllm_models"):
        code, _, text = call(url, "/v1/chat/completions", body)
    assert code == 400 and "unsupported content part" in error_of(text)
    assert len(text) < 1000
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)
    assert len(capfd.readouterr().err) < 1000


def test_a_chat_template_that_raises(served, caplog):
    server, url = served
    tok = text_tokenizer(server.service.tokenizer)
    original = tok.chat_template
    try:
        tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
        code, _, text = call(url, "/v1/chat/completions", CHAT)
        assert code == 400
        assert (
            error_of(text)
            == "the chat template refused the messages: Conversation roles must alternate"
        )
        tok.chat_template = "{{ messages[0]['content'] | int + (1 / 0) }}"
        code, _, text = call(url, "/v1/chat/completions", CHAT)
        assert code == 500 and "ZeroDivisionError" in error_of(text)
    finally:
        tok.chat_template = original
    assert call(url, "/v1/chat/completions", CHAT)[0] == 200


def test_a_bug_gets_a_500_and_one_log_line(served, monkeypatch, caplog, capfd):
    _, url = served

    def broken(self, *args, **kwargs):
        raise RuntimeError("boom " + "b" * 10_000)

    monkeypatch.setattr(Service, "request_settings", broken)
    with caplog.at_level(logging.INFO, logger="mlx_dllm_models"):
        code, _, text = call(url, "/v1/chat/completions", CHAT)
    assert code == 500 and error_of(text) == "internal error (RuntimeError); see the server log"
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 1 and "RuntimeError: boom" in failures[0] and len(failures[0]) < 400
    assert "Traceback" not in capfd.readouterr().err
