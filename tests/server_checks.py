"""What the serve-safety tests share: a server on a checkpoint over loopback HTTP, one request
to it (errors are answers too), and the module fixtures of the LLaDA and DiffusionGemma
checkpoints they serve."""

import json
import threading
import urllib.request

import pytest

from fixtures import build_once
from fixtures import diffusion_gemma as dgfx
from fixtures.llada import build_llada
from mlx_dllm_models import load
from mlx_dllm_models.server import make_server, shutdown

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
