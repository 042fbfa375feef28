"""Reliability, round two (issue 27): the commands under careless and hostile use.

Nothing a user owns is lost (fuse into the base model's folder, a converted config that misstates its
dtype), every mistake is one line instead of a traceback (lora, fuse, evaluate, convert, a rank
that dies under mlx.launch), work is bounded (the likelihood's sample count, a batch of prompts of
very different lengths), and a newcomer's papercuts (the default prompt, the README).

Each case failed before the change: a traceback, an overwritten checkpoint, a wrong config, work
without end, a padded batch slower than its prompts one by one."""

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from helpers import cli_env, mlx_lm_convert, run_cli, spy_forwards
from mlx_dllm_models import SettingsError, batch_generate_diffusion, load
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.default import DEFAULT_PROMPT, default_checkpoint
from mlx_dllm_models.tiny import build_tiny_llada

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_llada(tmp_path_factory.mktemp("rel2") / "llada")


def one_line_error(capsys, argv):
    """The command's error: SystemExit's message, or what it printed when it returned 1; checked
    to be one line starting with 'error: ' (a traceback would be an exception here)."""
    try:
        code = cli_main(argv)
    except SystemExit as e:
        assert isinstance(e.code, str), f"exit status {e.code!r}, not a message"
        message = e.code
    else:
        assert code == 1, f"exit status {code}"
        message = capsys.readouterr().err.strip()
    assert message.startswith("error: "), message
    assert "\n" not in message.strip(), message
    return message


def tree_digest(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------------------ §1 fuse, convert


@pytest.fixture(scope="module")
def fuse_inputs(tmp_path_factory):
    """A copy of the embedded default and LoRA adapters for it in mlx-lm's format (lora_b zero,
    as mlx-lm starts them: fusing gives the base weights back)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    root = tmp_path_factory.mktemp("fuse")
    base = root / "base"
    shutil.copytree(default_checkpoint(), base)
    model, _ = load(base)
    model.freeze()
    params = {"rank": 2, "scale": 1.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    adapters = root / "adapters"
    adapters.mkdir()
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(adapters / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (adapters / "adapter_config.json").write_text(json.dumps(config))
    return base, adapters


def _fuse(base, adapters, save_path):
    return ["fuse", "--model", str(base), "--adapter-path", str(adapters)] + [
        "--save-path",
        str(save_path),
    ]


@pytest.mark.parametrize("which", ["model", "adapters", "model, spelled differently"])
def test_fuse_never_writes_into_the_model_or_adapter_folder(capsys, fuse_inputs, which):
    base, adapters = fuse_inputs
    target = {"model": base, "adapters": adapters}.get(which, base / ".." / base.name)
    before = tree_digest(base), tree_digest(adapters)
    message = one_line_error(capsys, _fuse(base, adapters, target))
    folder = "adapter folder" if which == "adapters" else "model's folder"
    assert f"is the {folder}" in message, message
    assert (tree_digest(base), tree_digest(adapters)) == before


def test_fuse_refuses_an_existing_save_path(capsys, fuse_inputs, tmp_path):
    base, adapters = fuse_inputs
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    message = one_line_error(capsys, _fuse(base, adapters, tmp_path / "mine"))
    assert "already exists" in message
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "afile").write_text("keep me too")
    message = one_line_error(capsys, _fuse(base, adapters, tmp_path / "afile"))
    assert "already exists" in message and "a file" in message
    assert (tmp_path / "afile").read_text() == "keep me too"


def test_fuse_writes_beside_the_target_and_renames(fuse_inputs, tmp_path, monkeypatch):
    """An interrupted fuse leaves nothing; a complete one leaves exactly the target folder."""
    from mlx_dllm_models import conversion

    base, adapters = fuse_inputs
    out = tmp_path / "fused"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "finish_conversion", interrupted)
    assert cli_main(_fuse(base, adapters, out)) == 130
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert cli_main(_fuse(base, adapters, out)) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["fused"]
    fused, _ = load(out)
    assert not any("lora" in k for k, _ in fused.named_modules())
    assert sys.argv[0] != "mlx_dllm fuse"  # the command leaves the interpreter's argv alone


def _dtypes(folder: Path) -> set:
    from safetensors import safe_open

    found = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            found.update(f.get_slice(k).get_dtype() for k in f.keys())
    return found


@pytest.mark.slow
def test_convert_dtype_is_what_config_json_says(ckpt, tmp_path):
    """--dtype float16 wrote float16 weights under "torch_dtype": "float32": a second conversion
    (mlx-lm's default dtype is config.json's) would double the size again."""
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    config = json.loads((src / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    config["dtype"] = "float32"  # transformers 5 writes this name
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert (
        cli_main(["convert", "--hf-path", str(src), "--mlx-path", str(out), "--dtype", "float16"])
        == 0
    )
    written = json.loads((out / "config.json").read_text())
    assert _dtypes(out) == {"F16"}
    assert (written["torch_dtype"], written["dtype"]) == ("float16", "float16")
    # Plain `python -m mlx_lm convert` goes through the same finish_conversion, quantized too.
    q = mlx_lm_convert(src, tmp_path / "q", "--dtype", "bfloat16", "-q")
    written = json.loads((q / "config.json").read_text())
    assert (written["torch_dtype"], written["dtype"]) == ("bfloat16", "bfloat16")


# ------------------------------------------------------------------------------ §3 lora


ROWS = [
    {"prompt": f"What is {a}-{b}?", "completion": str(a - b)}
    for a, b in [(50, 20), (60, 25), (70, 33), (80, 41), (90, 12), (45, 13), (77, 22), (88, 19)]
]


def _write(folder: Path, name: str, lines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(line + "\n" for line in lines))


def _rows(rows):
    return [json.dumps(r) for r in rows]


def _lora(data, tmp_path, *flags):
    return ["lora", "--train", "--data", str(data), "--adapter-path", str(tmp_path / "ad")] + [
        "--iters",
        "1",
        "--batch-size",
        "4",
        "--steps-per-eval",
        "1000",
        "--val-batches",
        "1",
        *flags,
    ]


@pytest.mark.parametrize(
    "files, pattern",
    [
        ({"train": [], "valid": _rows(ROWS)}, r"train\.jsonl is empty"),
        ({"train": _rows(ROWS), "valid": []}, r"valid\.jsonl is empty"),
        (
            {"train": _rows(ROWS[:4]) + [json.dumps({"text": "hello"})] * 4, "valid": _rows(ROWS)},
            r'train\.jsonl line 5: a text \({"text"}\) row among completions \({"prompt"',
        ),
        (
            {
                "train": _rows(ROWS[:3]) + ['{"prompt": "x",'] + _rows(ROWS[3:]),
                "valid": _rows(ROWS),
            },
            r"train\.jsonl line 4: not valid JSON",
        ),
        (
            {"train": _rows(ROWS), "valid": _rows(ROWS[:2]) + ["[1, 2]"]},
            r"valid\.jsonl line 3: .*JSON object",
        ),
        (
            {"train": _rows(ROWS), "valid": _rows(ROWS[:2]) + ['{"question": "x"}']},
            r"valid\.jsonl line 3: .*no prompt / completion, messages or text",
        ),
    ],
    ids=["empty train", "empty valid", "mixed forms", "malformed line", "not an object", "keys"],
)
def test_lora_data_mistakes_are_one_line(capsys, tmp_path, files, pattern):
    data = tmp_path / "data"
    for name, lines in files.items():
        _write(data, f"{name}.jsonl", lines)
    message = one_line_error(capsys, _lora(data, tmp_path, "--num-layers", "1"))
    assert re.search(pattern, message), message
    assert str(data) in message  # the file is named with its folder


def test_lora_adapter_path_that_is_a_file(capsys, tmp_path):
    _write(tmp_path / "data", "train.jsonl", _rows(ROWS))
    _write(tmp_path / "data", "valid.jsonl", _rows(ROWS))
    (tmp_path / "ad").write_text("mine")
    message = one_line_error(capsys, _lora(tmp_path / "data", tmp_path))
    assert "--adapter-path" in message and "is a file" in message, message
    assert (tmp_path / "ad").read_text() == "mine"


def test_lora_missing_resume_adapter_file(capsys, tmp_path):
    _write(tmp_path / "data", "train.jsonl", _rows(ROWS))
    _write(tmp_path / "data", "valid.jsonl", _rows(ROWS))
    missing = tmp_path / "old" / "adapters.safetensors"
    argv = _lora(tmp_path / "data", tmp_path, "--resume-adapter-file", str(missing))
    message = one_line_error(capsys, argv)
    assert f"--resume-adapter-file {missing}" in message and "no such file" in message, message


@pytest.mark.slow
def test_lora_num_layers_beyond_the_model_adapts_every_layer(tmp_path):
    """README's command (mlx-lm's default --num-layers 16) on the embedded default (4 layers)."""
    from mlx_dllm_models import lora

    _write(tmp_path / "data", "train.jsonl", _rows(ROWS))
    _write(tmp_path / "data", "valid.jsonl", _rows(ROWS))
    for flags in ([], ["--num-layers", "99"]):
        out = tmp_path / f"ad{len(flags)}"
        args = lora.parse_args(
            ["--train", "--data", str(tmp_path / "data"), "--adapter-path", str(out)]
            + ["--iters", "1", "--batch-size", "4", "--steps-per-eval", "1000", *flags]
        )
        model, _ = lora.run(args)
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["num_layers"] == len(model.layers) == 4
        adapted = {k.split(".")[2] for k, _ in tree_flatten(model.trainable_parameters())}
        assert adapted == {"0", "1", "2", "3"}
        again, _ = load(default_checkpoint(), adapter_path=str(out))
        loaded = {k.split(".")[2] for k, _ in tree_flatten(again.parameters()) if "lora_a" in k}
        assert loaded == adapted, "the adapter did not reach every layer on load"


@pytest.mark.slow
def test_lora_errors_reach_the_terminal_as_one_line(tmp_path):
    """The same, end to end: stderr is one line, no traceback."""
    _write(tmp_path / "data", "train.jsonl", [])
    _write(tmp_path / "data", "valid.jsonl", _rows(ROWS))
    proc = run_cli(*_lora(tmp_path / "data", tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "train.jsonl is empty" in proc.stderr


# ------------------------------------------------------------------------------ §3 fuse


def test_fuse_missing_adapters(capsys, fuse_inputs, tmp_path):
    base, _ = fuse_inputs
    message = one_line_error(capsys, _fuse(base, tmp_path / "nothing", tmp_path / "out"))
    assert "--adapter-path" in message and "adapters.safetensors" in message, message
    empty = tmp_path / "empty"
    empty.mkdir()
    message = one_line_error(capsys, _fuse(base, empty, tmp_path / "out"))
    assert "adapter_config.json" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


# ------------------------------------------------------------------------------ §3 evaluate


@pytest.fixture
def lm_eval_offline(monkeypatch, tmp_path):
    pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--tasks", ""], "--tasks names no task"),
        (["--tasks", "arc_easy", " "], "--tasks names no task"),
        (
            ["--tasks", "x", "--include-path", "{tmp}/missing"],
            "--include-path .*missing: no such folder",
        ),
        (["--tasks", "x", "--include-path", "{tmp}/afile"], "--include-path .*afile is a file"),
    ],
)
def test_evaluate_flag_mistakes(capsys, lm_eval_offline, tmp_path, flags, pattern):
    (tmp_path / "afile").write_text("task: x\n")
    argv = ["evaluate", *[f.format(tmp=tmp_path) for f in flags]]
    message = one_line_error(capsys, argv)
    assert re.search(pattern, message), message


@pytest.mark.slow
def test_evaluate_unknown_task(capsys, lm_eval_offline, tmp_path):
    message = one_line_error(capsys, ["evaluate", "--tasks", "arc_easy", "no_such_task_here"])
    assert "unknown task 'no_such_task_here'" in message, message
    assert "'arc_easy'" not in message


# ------------------------------------------------------------------------------ §3 convert


def test_convert_into_an_unwritable_place(capsys, ckpt, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    message = one_line_error(
        capsys, ["convert", "--hf-path", str(ckpt), "--mlx-path", str(tmp_path / "afile" / "out")]
    )
    assert "cannot write" in message and "afile" in message, message

    readonly = tmp_path / "readonly"
    readonly.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: the error a read-only folder gives

        def refused(*args, dir=None, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))

        monkeypatch.setattr(tempfile, "mkdtemp", refused)
    else:
        readonly.chmod(0o555)
    try:
        message = one_line_error(
            capsys, ["convert", "--hf-path", str(ckpt), "--mlx-path", str(readonly / "out")]
        )
    finally:
        readonly.chmod(0o755)
    assert "cannot write" in message and "Permission denied" in message, message
    assert list(readonly.iterdir()) == []


def test_convert_failing_to_write_midway_leaves_nothing(capsys, ckpt, tmp_path, monkeypatch):
    """A read-only file system or a full disk found while writing the weights."""
    import mlx_lm.utils

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(mlx_lm.utils, "save_model", full)
    out = tmp_path / "out"
    message = one_line_error(capsys, ["convert", "--hf-path", str(ckpt), "--mlx-path", str(out)])
    assert "No space left on device" in message and str(out) in message, message
    assert list(tmp_path.iterdir()) == []


def test_convert_source_mistakes(capsys, ckpt, tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    out = str(tmp_path / "out")
    (tmp_path / "afile").write_text("x")
    message = one_line_error(
        capsys, ["convert", "--hf-path", str(tmp_path / "afile"), "--mlx-path", out]
    )
    assert "is a file" in message, message
    for missing in (str(tmp_path / "nowhere"), "./nowhere", "no/such/folder"):
        monkeypatch.chdir(tmp_path)
        message = one_line_error(capsys, ["convert", "--hf-path", missing, "--mlx-path", out])
        assert f"no checkpoint at {missing}" in message, message
        assert "Repo id" not in message

    truncated = tmp_path / "truncated"
    shutil.copytree(ckpt, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = one_line_error(capsys, ["convert", "--hf-path", str(truncated), "--mlx-path", out])
    assert str(truncated / "model.safetensors") in message and "truncated" in message, message

    sharded = tmp_path / "sharded"
    shutil.copytree(ckpt, sharded)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(sharded / file))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "model-00002-of-00002.safetensors").unlink()
    message = one_line_error(capsys, ["convert", "--hf-path", str(sharded), "--mlx-path", out])
    assert "model-00002-of-00002.safetensors" in message and "missing" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "sharded", "truncated"]


# ------------------------------------------------------------------------------ §3 a dead rank


DYING_RANK = """
import importlib, os, signal, sys

generate = importlib.import_module("mlx_dllm_models.generate")

if os.environ.get("MLX_RANK") == "1":  # dies once its first block is committed
    real = generate.responses

    def dying(*args, **kwargs):
        for response in real(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
            yield response

    generate.responses = dying

from mlx_dllm_models.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
def test_a_rank_that_dies_under_mlx_launch_generate(ckpt, tmp_path):
    """mlx.launch stops the other ranks with SIGTERM once one exits: that rank used to vanish
    without a word (exit -15); it ends with serve's one-line error and status 1."""
    import socket

    launch = Path(PYTHON).parent / "mlx.launch"
    if not launch.exists():
        pytest.fail(f"mlx.launch is not next to {PYTHON}; install mlx into this environment")
    script = tmp_path / "dying_rank.py"
    script.write_text(DYING_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(launch), "-n", "2", "--backend", "ring", "-p", str(port), "--python", PYTHON]
    cmd += [str(script), "generate", "--model", str(ckpt), "--prompt", "hi"]
    cmd += ["--max-tokens", "256", "--block-length", "8", "--no-live", "--ignore-chat-template"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "error: rank 0 of 2 lost contact with another rank" in out, out[-3000:]
    assert "Node with rank 0 exited with code 1" in out, out[-3000:]
    assert "Traceback" not in out


# ------------------------------------------------------------------------------ §4 bounded work


def test_log_likelihood_refuses_samples_beyond_its_cap(tmp_path):
    import time

    from mlx_dllm_models.likelihood import MAX_MC_SAMPLES, log_likelihood

    model, tok = load(default_checkpoint())
    tic = time.perf_counter()
    with pytest.raises(SettingsError, match=r"mc_samples \(1000000000\) is above .*2\*\*16"):
        log_likelihood(model, tok, "What is 47+85?", "132", mc_samples=10**9, batch_size=16)
    assert time.perf_counter() - tic < 5
    assert MAX_MC_SAMPLES == 2**16


LENGTHS = [1, 2, 3, 5, 40, 44, 90, 95, 100]


def _varied_prompts():
    return [[10 + (7 * i + j) % 240 for j in range(n)] for i, n in enumerate(LENGTHS)]


@pytest.mark.slow
def test_batch_of_very_different_lengths_is_no_more_work_than_one_by_one(ckpt):
    """A batch padded every row to its longest prompt: 9 prompts of 1-100 tokens did about 3x the
    forward work of the same prompts one by one. Rows of similar length now share runs: no more
    forwards, and at most an eighth more positions, than one by one, each row's tokens unchanged,
    in the caller's order."""
    model, tok = load(ckpt)
    prompts = _varied_prompts()
    order = [4, 0, 8, 2, 6, 1, 7, 3, 5]  # not sorted by length
    prompts = [prompts[i] for i in order]
    kw = dict(max_tokens=16, block_length=8, temperature=0)

    def work(fn):
        positions, forwards = [], []

        def record(inputs, cache, mask, head_span):
            forwards.append(1)
            positions.append(inputs.shape[0] * inputs.shape[1])

        with spy_forwards(model, record):
            out = fn()
        return out, sum(positions), len(forwards)

    alone = []

    def one_by_one():
        alone.extend(batch_generate_diffusion(model, tok, [p], **kw) for p in prompts)

    _, solo_positions, solo_forwards = work(one_by_one)
    batch, positions, forwards = work(lambda: batch_generate_diffusion(model, tok, prompts, **kw))
    assert batch.tokens == [a.tokens[0] for a in alone]
    assert batch.finish_reasons == [a.finish_reasons[0] for a in alone]
    assert batch.texts == [a.texts[0] for a in alone]
    assert batch.nfe == forwards <= solo_forwards
    assert positions <= 1.125 * solo_positions, (positions, solo_positions)
    assert forwards < solo_forwards  # rows of equal length did share runs


@pytest.mark.slow
def test_batch_above_temperature_0_is_reproducible(ckpt):
    model, tok = load(ckpt)
    prompts = _varied_prompts()
    kw = dict(max_tokens=8, block_length=8, temperature=1.0, seed=7)
    first = batch_generate_diffusion(model, tok, prompts, **kw)
    assert batch_generate_diffusion(model, tok, prompts, **kw).tokens == first.tokens
    assert batch_generate_diffusion(model, tok, prompts, **dict(kw, seed=8)).tokens != first.tokens


# ------------------------------------------------------------------------------ §5 papercuts


def test_generate_without_a_prompt_shows_the_question(capsys):
    assert cli_main(["generate", "--no-live"]) == 0
    captured = capsys.readouterr()
    assert DEFAULT_PROMPT in captured.err, captured
    assert captured.out.split("=" * 10)[0].strip() == "132"


@pytest.mark.slow
def test_conversion_prints_no_transformers_model_type_warning(tmp_path):
    from fixtures import all_checkpoints

    src = all_checkpoints()["sdar"](tmp_path / "sdar")
    proc = run_cli("convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    assert "You are using a model of type" not in proc.stdout + proc.stderr
    env = cli_env()
    code = (
        "import mlx_dllm_models_hook, runpy, sys; sys.argv = ['mlx_lm', 'convert', '--hf-path', "
        f"{str(src)!r}, '--mlx-path', {str(tmp_path / 'b')!r}]; "
        "runpy.run_module('mlx_lm', run_name='__main__')"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "You are using a model of type" not in proc.stdout + proc.stderr


def test_readme_states_python_version_and_where_commands_run():
    readme = (ROOT / "README.md").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'requires-python = ">=(3\.\d+)"', pyproject).group(1)
    assert re.search(rf"Python {re.escape(version)} or later", readme), version
    assert "from the root of a clone" in readme
    # The errors each command checks: the documentation's page on errors.
    errors = (ROOT / "docs" / "guide" / "errors.md").read_text()
    for case in ("lora", "fuse", "evaluate", "convert", "mlx.launch"):
        assert case in errors, case
