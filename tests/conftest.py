import contextlib
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx_dllm_models_hook  # noqa: E402,F401  (registers our model types with mlx-lm)


def load_fixture(path):
    """(model, tokenizer) through mlx-lm's own loader, in float32 (fixtures are written in float32).
    The fixtures carry an `auto_map` as real checkpoints do: without trust_remote_code=False,
    transformers would ask on stdin whether to run that (absent) code."""
    from mlx_lm.utils import load

    return load(str(path), tokenizer_config={"trust_remote_code": False})


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """A session-wide folder; `fixture_dir / name` holds a built checkpoint."""
    return tmp_path_factory.mktemp("checkpoints")


@contextlib.contextmanager
def spy_forwards(model, record):
    """`record(inputs, cache, mask, head_span)` sees every forward of `model` (other instances of
    its class run as usual); the class's own `__call__` is restored afterwards."""
    cls = type(model)
    real = cls.__call__
    own = "__call__" in cls.__dict__

    def spy(self, inputs, cache=None, mask=None, head_span=None):
        if self is model:
            record(inputs, cache, mask, head_span)
        return real(self, inputs, cache=cache, mask=mask, head_span=head_span)

    cls.__call__ = spy
    try:
        yield
    finally:
        if own:
            cls.__call__ = real
        else:
            del cls.__call__


def cli_env():
    """The environment of a CLI subprocess: this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_cli(*args, timeout=300):
    """`python -m mlx_dllm_models ARGS` in a fresh interpreter, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_dllm_models", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=ROOT,
    )


def stream_tokens(model, tok, prompt, **settings):
    """Every token the public stream returns for one prompt."""
    from mlx_dllm_models import stream_generate_diffusion

    return [t for r in stream_generate_diffusion(model, tok, prompt, **settings) for t in r.tokens]


def torch_logits_fn(model):
    """The model as a torch reference transcription calls it: ids -> float32 torch logits."""
    import mlx.core as mx
    import numpy as np
    import torch

    def forward(ids):
        logits = model(mx.array(np.asarray(ids), dtype=mx.int32))
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    return forward


def cut_at_eos(tokens, eos):
    """A reference's full canvas cut before its first EOS, as the package returns it."""
    tokens = [int(t) for t in tokens]
    at = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if at is None else tokens[:at]


def read_pty(fd, pid, timeout=120):
    """Everything a child on a pseudo-terminal writes until it closes the terminal, decoded;
    reaps the child."""
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            break
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
    os.waitpid(pid, 0)
    return out.decode("utf-8", "replace")
