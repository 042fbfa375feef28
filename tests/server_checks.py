"""What the server tests share: a server on a checkpoint over loopback HTTP, one request to it
(errors are answers too), OpenAI's client on it, a chat prompt as the server renders it, a grey PNG
as a request's data URL carries it (helpers.data_url writes a PIL image's), and the module
fixtures of the LLaDA and DiffusionGemma checkpoints the serve-safety tests serve."""

import base64
import json
import struct
import threading
import urllib.request
import zlib

import pytest
from openai import OpenAI

from fixtures import build_once
from fixtures import diffusion_gemma as dgfx
from fixtures.llada import build_llada
from mlx_dllm_models import load
from mlx_dllm_models.server import make_server, shutdown
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


def connect(url):
    # A timeout: a request the server never answered fails the test rather than hanging it.
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_prompt(tokenizer, content):
    messages = [{"role": "user", "content": content}]
    return text_tokenizer(tokenizer).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def post(url, path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def grey_png(width: int, height: int) -> bytes:
    """A valid grey PNG, compressed row by row (a 12000 x 12000 one is ~140 KB and is written
    without holding its pixels)."""

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    packer, row, parts = zlib.compressobj(9), b"\x00" * (width + 1), []
    for _ in range(height):
        parts.append(packer.compress(row))
    parts.append(packer.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", b"".join(parts))
        + chunk(b"IEND", b"")
    )


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def error_of(text):
    return json.loads(text)["error"]["message"]


def llada_served():
    """A test module's fixtures, bound as `llada_path, served = llada_served()`: the LLaDA
    checkpoint written once a session, and a server on it for the module, (server, url)."""

    @pytest.fixture(scope="module")
    def llada_path(fixture_dir):
        return build_once(fixture_dir / "safety_llada", build_llada)

    @pytest.fixture(scope="module")
    def served(llada_path):
        server, url = start(llada_path)
        yield server, url
        shutdown(server)

    return llada_path, served


def gemma_checkpoint():
    """A test module's fixture `gemma_path = gemma_checkpoint()`: the DiffusionGemma checkpoint
    written once a session."""

    @pytest.fixture(scope="module")
    def gemma_path(fixture_dir):
        return build_once(fixture_dir / "safety_gemma", dgfx.CHECKPOINTS["diffusion_gemma"])

    return gemma_path
