"""What the tests share beyond fixtures (conftest.py keeps those and the hooks): parity checks,
CLI and conversion subprocesses, the server's image answer, the two-rank launch."""

import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
from inspect import Parameter, Signature
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_fixture(path):
    """(model, tokenizer) through mlx-lm's own loader, in float32 (fixtures are written in float32).
    The fixtures carry an `auto_map` as real checkpoints do: without trust_remote_code=False,
    transformers would ask on stdin whether to run that (absent) code."""
    from mlx_lm.utils import load

    return load(str(path), tokenizer_config={"trust_remote_code": False})


def parity(a, b):
    """(whether `a` matches the reference `b` within the forward-parity tolerance, 1e-4 of b's
    largest magnitude plus 1e-5; the largest absolute error). The shapes must agree. Computed in
    float64: the float32 logits are compared exactly."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b).max()
    return err <= 1e-4 * np.abs(b).max() + 1e-5, err


def assert_close(a, b):
    ok, err = parity(a, b)
    assert ok, f"max abs error {err:.3g} (max |ref| {np.abs(np.asarray(b, np.float64)).max():.3g})"


def far(a, b):
    """`a` differs from `b` by more than 1% of b's largest magnitude: what a wrong reading (a
    causal mask for a bidirectional one, ...) must do, so that a parity check can tell."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() > 1e-2 * np.abs(b).max()


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
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


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


# `python -m mlx_lm convert` as a user runs it: the import hook is what the installed package's .pth
# file would import.
_CONVERT = (
    "import mlx_dllm_models_hook, runpy, sys; "
    "sys.argv = ['mlx_lm', 'convert', '--hf-path', sys.argv[1], '--mlx-path', sys.argv[2], "
    "*sys.argv[3:]]; "
    "runpy.run_module('mlx_lm', run_name='__main__')"
)


def mlx_lm_convert(src, dst, *flags):
    """`python -m mlx_lm convert` of `src` into `dst` in a fresh interpreter, with the import hook
    the installed package puts in a .pth; returns `dst`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(src), str(dst), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return dst


_CONVERT_AND_GENERATE = """
import json, runpy, sys
import mlx_dllm_models_hook
src, dst, prompts, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
sys.argv = ["mlx_lm", "convert", "--hf-path", src, "--mlx-path", dst]
try:
    runpy.run_module("mlx_lm", run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
from mlx_lm import load
from mlx_dllm_models import batch_generate_diffusion
model, tokenizer = load(dst)
tokens = batch_generate_diffusion(model, tokenizer, prompts, **settings).tokens
print("RESULT " + json.dumps({"module": type(model).__module__, "tokens": tokens}))
"""


def convert_and_generate(src, dst, prompts, **settings):
    """`python -m mlx_lm convert` of `src` into `dst`, then plain `mlx_lm.load` of the result and
    batch_generate_diffusion(prompts, **settings), in one fresh interpreter (one start where a
    convert and a load took two): {"config": the config.json written, "module": the model's
    module, "tokens": each row's}."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    args = [str(src), str(dst), json.dumps(prompts), json.dumps(settings)]
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT_AND_GENERATE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    out["config"] = json.loads((Path(dst) / "config.json").read_text())
    return out


def data_url(image) -> str:
    """A PIL image as the PNG data URL an `image_url` content part carries."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@contextlib.contextmanager
def serving(checkpoint, model_id):
    """`mlx_dllm serve` over the checkpoint on loopback, in a thread: yields its base URL
    (`http://127.0.0.1:PORT`) and shuts it down afterwards."""
    import threading

    from mlx_dllm_models import load
    from mlx_dllm_models.server import make_server, shutdown

    server = make_server(lambda: load(checkpoint), host="127.0.0.1", port=0, model_id=model_id)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        shutdown(server)


def served_image_answer(checkpoint, model_id, image, text, **settings) -> str:
    """The answer of `mlx_dllm serve` (on loopback, over the checkpoint) to one chat message of an
    image_url part (`image`) then a text part (`text`), with `settings` as body fields."""
    import urllib.request

    content = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": text},
    ]
    body = dict(settings, messages=[{"role": "user", "content": content}])
    with serving(checkpoint, model_id) as url:
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]


def vlm_convert_cli_and_serve(loaded, ckpt, tmp_path, capsys, picture, ids, model_id, settings):
    """For a LaViDa-style checkpoint `ckpt` loaded as `loaded`: mlx_vlm.convert's output loads
    through mlx_vlm.load with the same logits over ids[0] + picture(7)'s image slots + ids[1:];
    `mlx_dllm generate --image` and one served chat request with an image_url part (both with
    `settings`) answer what generate_diffusion does on the chat prompt of "<image>describe" with
    picture(8). Returns (mlx-vlm's model and processor, the chat prompt, the picture's path, the
    answer) for the caller's own checks."""
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.convert import convert

    from mlx_dllm_models import generate_diffusion
    from mlx_dllm_models.cli import main as cli_main
    from mlx_dllm_models.vision import text_tokenizer

    model, processor = loaded
    convert(str(ckpt), mlx_path=str(tmp_path / "vlm"))
    vlm_model, vlm_processor = mlx_vlm.load(str(tmp_path / "vlm"))
    tiles = processor.tiles(picture(7))
    theirs = [ids[:1] + vlm_model.image_slots(*tiles) + ids[1:]]
    mine = [ids[:1] + model.image_slots(*tiles) + ids[1:]]
    assert np.array_equal(np.array(vlm_model(mx.array(theirs))), np.array(model(mx.array(mine))))

    messages = [{"role": "user", "content": "<image>describe"}]
    chat = text_tokenizer(processor).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    path = tmp_path / "picture.png"
    picture(8).save(path)
    want = generate_diffusion(model, processor, chat, image=str(path), **settings)
    assert want.strip()
    args = ["generate", "--model", str(ckpt), "--prompt", "<image>describe", "--image", str(path)]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    assert cli_main(args + flags + ["--no-live"]) == 0
    assert want in capsys.readouterr().out
    assert served_image_answer(ckpt, model_id, picture(8), "describe", **settings) == want
    return vlm_model, vlm_processor, chat, path, want


def job_gone_after_looks(*args, looks: int, **kwargs):
    """A server Job (`Job(*args, **kwargs)`) whose client goes away once the scheduler has looked
    `looks` times at whether it is cancelled."""
    from mlx_dllm_models.server import Job

    class GoneAfterLooks(Job):
        def __init__(self):
            self.looks, self.limit = 0, looks
            super().__init__(*args, **kwargs)

        @property
        def cancelled(self):
            self.looks += 1
            return self.looks > self.limit

        @cancelled.setter
        def cancelled(self, value):
            pass

    return GoneAfterLooks()


class Ranks:
    """Stands for a group of `n` ranks: `shard` reads its size and rank before splitting, so a
    refusal needs no second process."""

    def __init__(self, n: int, rank: int = 0):
        self.n, self.r = n, rank

    def size(self):
        return self.n

    def rank(self):
        return self.r


def checkpoint_fixtures(folder, build, loaded="loaded", name="ckpt", loader=None):
    """A test module's two module-scoped fixtures, bound as `ckpt, loaded = checkpoint_fixtures(
    "coda", build)`: the checkpoint `build` writes once a session as fixture_dir / folder (named
    `name`), and (named `loaded`) its load by `loader` (the package's `load` unless given); a dict
    `build` parametrizes the checkpoint over its keys, each written as folder_<key>."""
    from fixtures import build_once

    many = isinstance(build, dict)

    @pytest.fixture(scope="module", name=name, params=sorted(build) if many else None)
    def checkpoint(request, fixture_dir):
        where = f"{folder}_{request.param}" if many else folder
        return build_once(fixture_dir / where, build[request.param] if many else build)

    def loaded_checkpoint(**checkpoint):
        from mlx_dllm_models import load

        return (loader or load)(checkpoint[name])

    # pytest reads a fixture's dependencies off its signature: this one's is the checkpoint `name`.
    loaded_checkpoint.__signature__ = Signature([Parameter(name, Parameter.KEYWORD_ONLY)])
    return checkpoint, pytest.fixture(scope="module", name=loaded)(loaded_checkpoint)


def checkpoint_copy(ckpt, tmp_path, name="ckpt"):
    """A copy of the checkpoint folder `ckpt` as tmp_path / name, to damage or edit."""
    return shutil.copytree(ckpt, tmp_path / name)


def edit_json(path, fn, name="config.json"):
    """Applies `fn` to the JSON file `name` of the folder `path`, in place."""
    cfg = json.loads((path / name).read_text())
    fn(cfg)
    (path / name).write_text(json.dumps(cfg))


def random_prompt(n, seed):
    """`n` ids below 256 (the tiny fixtures' byte tokens) drawn with `seed`."""
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def random_picture(seed, size):
    """An RGB PIL image of `size` (height, width) of uniform noise drawn with `seed`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype(np.uint8))


def decoded(decoder, prompts):
    """(each row's tokens over `decoder.run(prompts)`, gathered from its block events by row, the
    decoder's forward count)."""
    from mlx_dllm_models.engine import BlockEvent

    out = [[] for _ in prompts]
    for event in decoder.run(prompts):
        if isinstance(event, BlockEvent):
            for row, toks in zip(event.rows, event.tokens):
                out[row].extend(toks)
    return out, decoder.nfe


def stream_tokens(model, tok, prompt, **settings):
    """Every token the public stream returns for one prompt."""
    from mlx_dllm_models import stream_generate_diffusion

    return [t for r in stream_generate_diffusion(model, tok, prompt, **settings) for t in r.tokens]


def single_call(model, tok, prompt, **settings):
    """(tokens, text, finish reason) of one `stream_generate_diffusion` call: the reference a
    served or batched request is held to."""
    from mlx_dllm_models import stream_generate_diffusion

    tokens, text, reason = [], "", None
    for r in stream_generate_diffusion(model, tok, prompt, **settings):
        tokens += r.tokens
        text += r.text
        reason = r.finish_reason
    return tokens, text, reason


def submit_while_running(scheduler, jobs):
    """`jobs` submitted one after the other, the scheduler stepped once after each (so that the
    later ones join a running batch); the submitted jobs."""
    submitted = []
    for job in jobs:
        submitted.append(scheduler.submit(job))
        scheduler.step()
    return submitted


def step_to_the_end(scheduler, limit=200):
    """Steps `scheduler` until it has no work left; one that still has work after `limit` steps
    fails the test."""
    for _ in range(limit):
        if not scheduler.step():
            return
    raise AssertionError(f"the scheduler still had work after {limit} steps")


def torch_logits_fn(model):
    """The model as a torch reference transcription calls it: ids -> float32 torch logits."""
    import mlx.core as mx
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


def cli_on_pty(*args, size=None, sigint_default=False):
    """(pid, fd) of `python -m mlx_dllm_models *args` (cli_env) started on a new pseudo-terminal,
    of `size` (rows, cols) when given (COLUMNS and LINES then leave its environment, so that the
    terminal's size is what it reads). `sigint_default`: it starts as a shell starts a program on
    a terminal, with ^C's default action; a suite run in the background of a non-interactive shell
    (`pytest &`, nohup) has SIGINT ignored, a child inherits that, and Python then never installs
    its handler, so no ^C would reach it."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:
        env = cli_env()
        if size is not None:
            import fcntl
            import struct
            import termios

            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
            env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
        if sigint_default:
            import signal

            signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "mlx_dllm_models", *args], env)
    return pid, fd


def pty_session(fd, pid, timeout=120, on_output=None):
    """(everything a child on a pseudo-terminal writes until it closes the terminal, as bytes; its
    exit status). `on_output(out)` sees the output so far after each read (to type an answer).
    Reaps the child, killed first if it wrote nothing for `timeout` seconds: a hung child fails its
    test instead of holding the suite."""
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            os.kill(pid, 9)
            break
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
        if on_output is not None:
            on_output(out)
    _, status = os.waitpid(pid, 0)
    return out, os.waitstatus_to_exitcode(status)


def read_pty(fd, pid, timeout=120):
    """Everything a child on a pseudo-terminal writes until it closes the terminal, decoded (see
    pty_session)."""
    return pty_session(fd, pid, timeout)[0].decode("utf-8", "replace")


MLX_LAUNCH = Path(sys.executable).parent / "mlx.launch"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_ranks(script, *args, out, timeout=300):
    """`python script *args` on two ranks of mlx.launch's ring backend on loopback; each rank
    writes OUT/rank<r>.npz, which are returned. mlx.launch exits 0 even when a rank fails: the
    ranks' files are what tells."""
    if not MLX_LAUNCH.exists():
        pytest.fail(
            f"mlx.launch is not next to {sys.executable}; install mlx into this environment"
        )
    cmd = [str(MLX_LAUNCH), "-n", "2", "--backend", "ring", "-p", str(free_port())]
    cmd += ["--python", sys.executable, str(script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for rank in (0, 1):
        assert (out / f"rank{rank}.npz").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [np.load(out / f"rank{r}.npz") for r in (0, 1)]


def assert_sharded_is_one_process(one, ranks, name="", tokens=None):
    """Two ranks' results against one process's (keys `{name}/logits`, `/tokens`, `/weights`, or
    bare with name ""): logits bitwise the same on both ranks and within 1e-4 of one process's
    largest logit (only the summation order differs), the same tokens (`tokens` of them, or some),
    and rank 0 holding less of the weights."""
    key = (lambda k: f"{name}/{k}") if name else (lambda k: k)
    logits = key("logits")
    np.testing.assert_array_equal(ranks[0][logits], ranks[1][logits], err_msg=name)
    scale = np.abs(one[logits]).max()
    assert np.abs(ranks[0][logits] - one[logits]).max() <= 1e-4 * scale, name
    want = one[key("tokens")].tolist()
    assert len(want) == tokens if tokens is not None else len(want) > 0, name
    for got in ranks:
        assert got[key("tokens")].tolist() == want, name
    assert ranks[0][key("weights")] < one[key("weights")], name


def batch_equal_to_single_runs(model, tok, prompts, images=None, **settings):
    """batch_generate_diffusion over `prompts` (with `images`, one entry a prompt, when given),
    once each row is checked to hold the tokens its prompt's single run returns (a batch row
    decodes as it would alone)."""
    from mlx_dllm_models import batch_generate_diffusion

    if images is None:
        batch = batch_generate_diffusion(model, tok, prompts, **settings)
        singles = [stream_tokens(model, tok, p, **settings) for p in prompts]
    else:
        batch = batch_generate_diffusion(model, tok, prompts, images=images, **settings)
        singles = [
            stream_tokens(model, tok, p, image=i, **settings) for p, i in zip(prompts, images)
        ]
    for got, single in zip(batch.tokens, singles):
        assert got == single
    return batch


def assert_image_reads_as_feature_ids(model, processor, image, other, **settings):
    """A vision family's generate with `image` equals generate from the prompt of its feature ids
    (the processor's input_ids), and the `other` image gives other tokens (the image is read)."""
    text = "<image>What is it?"
    got = stream_tokens(model, processor, text, image=image, **settings)
    ids = processor(text=[text], images=[image])["input_ids"][0]
    assert got == stream_tokens(model, processor, ids, **settings)
    assert stream_tokens(model, processor, text, image=other, **settings) != got


def assert_one_rank_keeps_logits_and_three_are_refused(model, ids):
    """`model.shard` over three ranks is refused before any weight changes (for the tiny
    fixtures' sizes), and over the single-process group keeps the logits of `ids`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dllm_models import SettingsError

    before = np.array(model(ids))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    with pytest.raises(SettingsError, match="cannot split the checkpoint over 3 ranks"):
        model.shard(Ranks(3))
    assert {k: v.shape for k, v in tree_flatten(model.parameters())} == shapes
    model.shard(mx.distributed.init())  # the single-process group
    np.testing.assert_allclose(np.array(model(ids)), before, rtol=1e-5, atol=1e-5)


def mlx_vlm_llada2(path, **config):
    """mlx-vlm's llada2_moe language model (an independent implementation) on a checkpoint, through
    its own config (`config`: entries over config.json's) and sanitize."""
    import mlx.core as mx
    from mlx_vlm.models.llada2_moe import Model
    from mlx_vlm.models.llada2_moe.config import ModelConfig

    cfg = {**json.loads((Path(path) / "config.json").read_text()), **config}
    model = Model(ModelConfig.from_dict(cfg))
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    model.load_weights(list(model.sanitize(weights).items()))
    return model.language_model


class RecordedDraws:
    """The engine's uniform draws, recorded and replayed to a reference (BD3-LM's sampler): the
    token draws of each step (stats.uniform over the step's window) and the position draws
    (sampler "random"); draws the engine never made come from the same generator.
    The reference's block starts at the block's first column; the engine's window at the
    prompt's end in the first block, so the reference's extra columns (committed prompt tokens)
    get filler draws."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.tokens, self.positions = [], []
        self.made = 0

    def ours_tokens(self, key, shape, low=0.0):
        import mlx.core as mx

        u = np.maximum(self.rng.random(shape), 1e-12).astype(np.float32)
        self.tokens.append(u)
        self.made += 1
        return mx.array(u)

    def ours_positions(self, key, shape):
        import mlx.core as mx

        u = self.rng.random(shape).astype(np.float32)
        self.positions.append(u)
        return mx.array(u)

    def ref_tokens(self, shape):
        u = self.tokens.pop(0) if self.tokens else self.rng.random(shape)
        pad = shape[1] - u.shape[1]
        return np.concatenate([np.full((shape[0], pad, shape[2]), 0.5), u], axis=1)

    def ref_position(self, masked):
        masked = masked.numpy()
        u = self.positions.pop(0) if self.positions else self.rng.random(masked.shape)
        u = np.concatenate([np.zeros((u.shape[0], masked.shape[1] - u.shape[1])), u], axis=1)
        return np.where(masked, u, -1.0).argmax(axis=1)
