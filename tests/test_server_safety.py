"""`mlx_dllm serve` is safe to run on a laptop (issue #27 §2), over real HTTP on loopback: no
cross-origin access unless --cors-origin names the origin (preflight too); no request naming a host
the server does not serve (DNS rebinding) unless --allowed-host names it; image URLs only as data
URLs unless --allowed-image-dir / --allow-remote-images allow files / public URLs, with one message
for every refused image; a body over --max-body-bytes is a 413 and a prompt that cannot fit in
the context a 400 before it is tokenized; flags out of range are one-line errors, a non-loopback
host a warning; a bad body (invalid UTF-8, no role, deep nesting, a template that raises) gets an
OpenAI error and one short log line; a disconnected client's row leaves at the next denoising step
(exactly for the rows that stay); SIGTERM while a request runs ends the process with status 0."""

import base64
import http.server
import io
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest
from PIL import Image

from fixtures import build_once
from fixtures import diffusion_gemma as dgfx
from fixtures.llada import build_llada
from fixtures.sdar import build_sdar
from helpers import job_gone_after_looks
from helpers import stream_tokens as single
from mlx_dllm_models import load
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.server import Job, Scheduler, make_server, shutdown
from mlx_dllm_models.server import images as images_module
from mlx_dllm_models.server.api import Service
from mlx_dllm_models.server.guards import HostCheck
from mlx_dllm_models.server.images import REFUSED, ImagePolicy, public_address
from mlx_dllm_models.server.process import check_args, loopback
from mlx_dllm_models.server.process import parser as serve_parser
from mlx_dllm_models.vision import text_tokenizer

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def start(path, model_id="fixture", **kwargs):
    server = make_server(lambda: load(path), host="127.0.0.1", port=0, model_id=model_id, **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def call(url, path, body=None, raw=None, headers=None, method=None, timeout=120):
    """(status, headers, decoded body) of one request; errors are answers too."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def error_of(text):
    return json.loads(text)["error"]["message"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llada_path(fixture_dir):
    return build_once(fixture_dir / "safety_llada", build_llada)


@pytest.fixture(scope="module")
def served(llada_path):
    server, url = start(llada_path)
    yield server, url
    shutdown(server)


# ------------------------------------------------------------------------------ cross-origin


PAGE = "http://evil.example"


def test_cross_origin_requests_are_refused_by_default(served):
    _, url = served
    # curl and OpenAI's clients send no Origin: answered, with no CORS header.
    status, headers, _ = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 200 and headers.get("Access-Control-Allow-Origin") is None
    # A web page's request carries its Origin: refused before anything runs, and the answer
    # carries no header that would let the page read it.
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("OPTIONS", "/v1/chat/completions", None),  # the browser's preflight
    ]:
        status, headers, text = call(url, path, body, headers={"Origin": PAGE}, method=method)
        assert status == 403, (method, path)
        assert "--cors-origin" in error_of(text)
        assert headers.get("Access-Control-Allow-Origin") is None


def test_cors_origin_allows_the_origins_it_names(llada_path):
    app = "http://localhost:3000"
    server, url = start(llada_path, cors_origins=[app])
    try:
        preflight = {
            "Origin": app,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        }
        status, headers, _ = call(url, "/v1/chat/completions", headers=preflight, method="OPTIONS")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == app
        assert headers["Vary"] == "Origin" and "POST" in headers["Access-Control-Allow-Methods"]
        status, headers, text = call(url, "/v1/chat/completions", CHAT, headers={"Origin": app})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == app
        status, headers, _ = call(url, "/v1/chat/completions", CHAT, headers={"Origin": PAGE})
        assert status == 403 and headers.get("Access-Control-Allow-Origin") is None
    finally:
        shutdown(server)


# ------------------------------------------------------------------------- DNS rebinding


def test_a_request_naming_another_host_is_refused(served, capsys):
    """A page on evil.example that points its own name at 127.0.0.1 (DNS rebinding) makes the
    browser's requests same-origin, with no Origin header to refuse, but they name evil.example
    in their Host header: a 403 in OpenAI's error shape before anything runs."""
    server, url = served
    port = server.server_address[1]
    before = server.service.scheduler.blocks
    for method, path, body in [
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("OPTIONS", "/v1/chat/completions", None),
    ]:
        for host in (f"evil.example:{port}", "evil.example", "localhost.evil.example", ""):
            status, _, text = call(url, path, body, headers={"Host": host}, method=method)
            assert status == 403, (method, path, host)
            error = json.loads(text)["error"]
            assert error["type"] == "invalid_request_error" and "--allowed-host" in error["message"]
    assert server.service.scheduler.blocks == before  # nothing decoded for them
    # This machine's loopback names, any port, in any case: answered.
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LocalHost", "[::1]"):
        status, _, _ = call(url, "/v1/models", headers={"Host": host})
        assert status == 200, host
    status, _, _ = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 200  # urllib's own Host (127.0.0.1:PORT)


def test_host_check_names():
    default = HostCheck("127.0.0.1")
    assert default.allows(None)  # no Host header: no browser sent it (HTTP/1.0)
    assert not default.allows("evil.example") and not default.allows("192.168.1.5:8080")
    named = HostCheck("127.0.0.1", ["my-box.lan", "10.0.0.7"])
    assert named.allows("MY-BOX.LAN.:8080") and named.allows("10.0.0.7:80")
    assert not named.allows("evil.example")
    assert HostCheck("127.0.0.1", ["*"]).allows("anything.example")
    # A non-loopback bind serves its own name or address; a wildcard bind any IP address (a page
    # served from an address is that address's: there is no name to point elsewhere).
    assert HostCheck("my-box.lan").allows("my-box.lan:8080")
    assert HostCheck("192.168.1.5").allows("192.168.1.5:8080")
    assert not HostCheck("192.168.1.5").allows("evil.example")
    wild = HostCheck("0.0.0.0")
    assert wild.allows("192.168.1.5:8080") and wild.allows("[fe80::1]:8080")
    assert not wild.allows("evil.example:8080")


def test_allowed_host_adds_names(llada_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0
    assert "--allowed-host NAME" in capsys.readouterr().out
    args = serve_parser().parse_args(
        ["--allowed-host", "proxy.lan,10.0.0.7", "--allowed-host", "x"]
    )
    check_args(args)
    assert args.allowed_hosts == ["proxy.lan", "10.0.0.7", "x"]
    server, url = start(llada_path, allowed_hosts=args.allowed_hosts)
    try:
        port = server.server_address[1]
        for host in (f"proxy.lan:{port}", "10.0.0.7", "localhost"):
            status, _, _ = call(url, "/v1/chat/completions", CHAT, headers={"Host": host})
            assert status == 200, host
        status, _, text = call(url, "/v1/chat/completions", CHAT, headers={"Host": "evil.example"})
        assert status == 403 and "--allowed-host" in error_of(text)
    finally:
        shutdown(server)


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


# --------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decode-concurrency", "0"], "--decode-concurrency must be at least 1"),
        (["--decode-concurrency", "-3"], "--decode-concurrency must be at least 1"),
        (["--port", "99999"], "--port must be from 0 to 65535"),
        (["--port", "-1"], "--port must be from 0 to 65535"),
        (["--prompt-cache-size", "-1"], "--prompt-cache-size must be 0"),
        (["--prompt-cache-bytes", "0"], "--prompt-cache-bytes must be more than 0"),
        (["--max-body-bytes", "10"], "--max-body-bytes must be at least 1024"),
        (["--allowed-image-dir", "/no/such/folder"], "is not a folder"),
        (["--allowed-host", "http://proxy.lan/"], "--allowed-host takes a host name or address"),
    ],
)
def test_flags_out_of_range_are_one_line_errors(flags, message, monkeypatch):
    monkeypatch.setattr("mlx_dllm_models.server.process.make_server", None)  # never reached
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", *flags])
    text = str(e.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text


def test_loopback_hosts():
    assert loopback("127.0.0.1") and loopback("localhost") and loopback("::1")
    assert not loopback("0.0.0.0") and not loopback("::")


# -------------------------------------------------------------------------------------- images


def png_bytes(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    pixels = (rng.random((dgfx.IMAGE_SIZE, dgfx.IMAGE_SIZE, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Recorder(http.server.BaseHTTPRequestHandler):
    """A local web server that serves one PNG (or a redirect) and records every request: what a
    refused URL must never reach."""

    hits: list = []
    body = b""

    def do_GET(self):
        type(self).hits.append((self.path, self.headers.get("Host")))
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/x.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(type(self).body)))
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web():
    Recorder.body = png_bytes(7)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def gemma_path(fixture_dir):
    return build_once(fixture_dir / "safety_gemma", dgfx.CHECKPOINTS["diffusion_gemma"])


@pytest.fixture(scope="module")
def gemma_default(gemma_path):
    server, url = start(gemma_path)
    yield url
    shutdown(server)


def ask_image(url, image, timeout=120):
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": image}}]
    body = {"messages": [{"role": "user", "content": content}], "seed": 0}
    body.update(max_tokens=dgfx.CANVAS_LENGTH, max_denoising_steps=2)
    status, _, text = call(url, "/v1/chat/completions", body, timeout=timeout)
    return status, json.loads(text)


def test_image_urls_are_data_urls_only_by_default(gemma_default, web, tmp_path):
    url = gemma_default
    Recorder.hits.clear()
    picture = tmp_path / "cat.png"
    picture.write_bytes(png_bytes(1))
    refused = [
        "/etc/passwd",  # exists
        "/etc/shadow",  # exists, unreadable
        "/no/such/file.png",  # does not: the same answer
        str(picture),  # a real image
        f"file://{picture}",
        f"http://127.0.0.1:{web}/cat.png",
        "https://example.com/cat.png",
    ]
    for image in refused:
        status, answer = ask_image(url, image)
        assert status == 400 and answer["error"]["message"] == REFUSED, image
    assert Recorder.hits == []  # nothing was fetched
    status, answer = ask_image(url, data_url(png_bytes(1)))
    assert status == 200 and answer["choices"][0]["message"]["content"]


def test_allowed_image_dir_reads_files_under_it_only(gemma_path, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(1))
    (outside / "dog.png").write_bytes(png_bytes(2))
    (allowed / "link.png").symlink_to(outside / "dog.png")  # a link out of the folder
    server, url = start(gemma_path, image_policy=ImagePolicy(allowed_dir=allowed))
    try:
        status, by_file = ask_image(url, str(allowed / "cat.png"))
        assert status == 200
        status, by_data = ask_image(url, data_url(png_bytes(1)))
        assert by_file["choices"][0]["message"] == by_data["choices"][0]["message"]
        for image in [
            str(outside / "dog.png"),
            str(allowed / ".." / "outside" / "dog.png"),
            str(allowed / "link.png"),
            str(allowed / "missing.png"),
            "/etc/passwd",
            "http://127.0.0.1:1/cat.png",  # remote images stay off
        ]:
            status, answer = ask_image(url, image)
            assert status == 400 and answer["error"]["message"] == REFUSED, image
    finally:
        shutdown(server)


@pytest.mark.parametrize(
    "address, public",
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:192.168.0.1", False),
    ],
)
def test_public_addresses(address, public):
    assert public_address(address) == public


def test_remote_images_refuse_loopback_and_private_hosts(gemma_path, web, monkeypatch):
    server, url = start(gemma_path, image_policy=ImagePolicy(allow_remote=True))
    try:
        Recorder.hits.clear()
        for image in [
            f"http://127.0.0.1:{web}/cat.png",
            f"http://localhost:{web}/cat.png",  # refused after resolving the name
            f"http://[::ffff:127.0.0.1]:{web}/cat.png",
            f"http://2130706433:{web}/cat.png",  # 127.0.0.1 as one number
            "http://10.0.0.1/cat.png",
            "http://169.254.169.254/latest/meta-data",
            "http://0.0.0.0/cat.png",
            "ftp://example.com/cat.png",
        ]:
            started = time.perf_counter()
            status, answer = ask_image(url, image)
            assert status == 400 and answer["error"]["message"] == REFUSED, image
            assert time.perf_counter() - started < 10  # refused before any connection
        assert Recorder.hits == []
        # A host whose addresses pass the check is fetched from the address that was checked,
        # with the URL's host in the Host header; a redirect is not followed.
        monkeypatch.setattr(images_module, "public_address", lambda address: True)
        status, fetched = ask_image(url, f"http://localhost:{web}/cat.png")
        assert status == 200, fetched
        assert Recorder.hits == [("/cat.png", f"localhost:{web}")]
        status, by_data = ask_image(url, data_url(Recorder.body))
        assert fetched["choices"][0]["message"] == by_data["choices"][0]["message"]
        status, answer = ask_image(url, f"http://localhost:{web}/redirect")
        assert status == 400 and answer["error"]["message"] == REFUSED
    finally:
        shutdown(server)


# ------------------------------------------------------------------ cancellation and shutdown


class GoneAfterFirstBlock(Job):
    """A job whose client goes away once its first block has come and the scheduler has looked
    twice more (it looks at every step's start and between every two denoising steps)."""

    looks = 0

    @property
    def cancelled(self):
        if self.tokens:
            self.looks += 1
        return self.looks > 2

    @cancelled.setter
    def cancelled(self, value):
        pass


@pytest.mark.parametrize("build", [build_llada, build_sdar])
def test_a_cancelled_row_leaves_mid_block_and_the_others_are_exact(fixture_dir, build):
    """Two rows share a run; one is cancelled a few steps into the second block. The decoder drops
    it before its next step (the run neither ends nor restarts) instead of carrying it through the
    block's remaining steps; the survivor's tokens are a single call's."""
    path = build_once(fixture_dir / f"safety_{build.__name__}", build)
    model, tokenizer = load(path)
    settings = dict(max_tokens=32, block_length=16, steps=16)
    scheduler = Scheduler(model, tokenizer)
    gone = scheduler.submit(GoneAfterFirstBlock("a story about the sea", dict(settings)))
    stays = scheduler.submit(Job("hi there", dict(settings)))
    for _ in range(50):
        if not scheduler.step():
            break
    assert stays.done and gone.done and scheduler.rows_dropped == 1 and scheduler.cut_short == 0
    assert 0 < len(gone.tokens) <= 16  # its first block only (block-causal: what the prompt left)
    assert stays.tokens == single(model, tokenizer, "hi there", **settings)


@pytest.mark.slow
def test_a_lone_cancelled_canvas_row_ends_its_run_at_the_next_step(gemma_path):
    """A decoder that takes no rows once started (DiffusionGemma's canvas) cannot restart the
    others, but a run whose only row is cancelled ends at the next denoising step."""
    model, processor = load(gemma_path)
    settings = dict(max_tokens=dgfx.CANVAS_LENGTH, max_denoising_steps=32, seed=0)
    alone = Scheduler(model, processor)
    alone.submit(Job("hi", dict(settings)))
    while alone.step():
        pass
    scheduler = Scheduler(model, processor)
    gone = scheduler.submit(job_gone_after_looks("hi", dict(settings), looks=4))
    while scheduler.step():
        pass
    assert gone.done and gone.tokens == [] and scheduler.cut_short == 1
    print(f"canvas: cut after {scheduler.forwards} forwards of {alone.forwards}")
    assert scheduler.forwards <= 4 < alone.forwards


def test_a_client_that_disconnects_mid_block_frees_the_server_at_the_next_step(served):
    server, url = served
    scheduler = server.service.scheduler
    # One block of 256 steps: at this fixture's speed here, seconds of work.
    body = {"prompt": "a long story", "max_tokens": 256, "block_length": 256, "steps": 256}
    data = json.dumps(dict(body, stream=True)).encode()
    before = scheduler.cut_short
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        deadline = time.time() + 60
        while True:
            runs = [g for g in list(scheduler.groups.values()) if g.run is not None]
            if runs and runs[0].decoder.nfe >= 3:
                decoder = runs[0].decoder
                break
            assert time.time() < deadline, "the request did not start"
            time.sleep(0.005)
        at_close = decoder.nfe
    closed = time.perf_counter()
    while any(not g.idle for g in list(scheduler.groups.values())):
        assert time.perf_counter() - closed < 30
        time.sleep(0.005)
    freed = time.perf_counter() - closed
    steps_after = decoder.nfe - at_close
    assert scheduler.cut_short == before + 1
    assert steps_after < 64, steps_after  # of the block's 256
    started = time.perf_counter()
    status, _, _ = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 32})
    assert status == 200
    print(
        f"disconnect: freed after {steps_after} more steps, {freed * 1000:.0f} ms; a 32-token "
        f"request then took {(time.perf_counter() - started) * 1000:.0f} ms"
    )


def serve_process(path, *flags):
    """A `mlx_dllm serve` subprocess on a free port, once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_dllm_models", "serve", "--model", str(path)]
    proc = subprocess.Popen(
        cmd + ["--port", str(port), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_right_after_a_request_exits_0(llada_path):
    """The worker thread ran MLX's compiled functions: a process that exited while that thread's
    C++ thread-locals were being destroyed aborted ("terminate called without an active
    exception", -6 here; it did in 2 of 2 and 3 of 3 such runs before worker.park), so one run
    tells."""
    proc, url = serve_process(llada_path)
    try:
        status, _, _ = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 32})
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0 and "terminate called" not in err, (code, err[-2000:])


@pytest.mark.slow
def test_sigterm_while_a_request_runs_exits_0_in_order(llada_path):
    """A real `mlx_dllm serve` process (on 0.0.0.0, which it warns about), a streamed and a plain
    request running, then SIGTERM: both get the shutting-down error, the process exits 0 at
    once, with no abort from a thread left running."""
    proc, url = serve_process(llada_path, "--host", "0.0.0.0")
    try:
        long = {"prompt": "a long story", "max_tokens": 512, "block_length": 32, "steps": 32}
        plain = {}

        def ask_plain():
            plain["answer"] = call(url, "/v1/completions", dict(long, block_length=64))

        waiter = threading.Thread(target=ask_plain)
        waiter.start()
        req = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(dict(long, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )
        stream = urllib.request.urlopen(req, timeout=120)
        first = stream.readline()
        while not first.startswith(b"data: "):
            first = stream.readline()
        signalled = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        rest = stream.read().decode()
        code = proc.wait(timeout=60)
        took = time.perf_counter() - signalled
        waiter.join(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, err[-2000:]
    assert "terminate called" not in err and "Traceback" not in err, err[-2000:]
    assert "listening on 0.0.0.0: other machines that can reach it can use the model" in err
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    status, _, text = plain["answer"]
    assert status == 503 and "shutting down" in error_of(text)
    print(f"SIGTERM with two requests running: exit 0 after {took * 1000:.0f} ms")
