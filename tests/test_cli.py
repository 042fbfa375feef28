"""The CLI in a subprocess: live canvas on a terminal, plain output otherwise, clear errors, convert."""

import re

import pytest

from helpers import cli_on_pty, read_pty, run_cli
from mlx_dllm_models.tiny import build_tiny_llada


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_llada(tmp_path_factory.mktemp("cli") / "llada")


STATS = re.compile(r"NFE: (\d+), ([\d.]+) tokens/forward \| Peak memory: [\d.]+ GB")


@pytest.mark.slow
def test_generate_prints_text_and_statistics(ckpt):
    out = run_cli(
        "generate",
        "--model",
        str(ckpt),
        "--prompt",
        "hello",
        "--max-tokens",
        "16",
        "--block-length",
        "8",
        "--steps",
        "4",
        "--no-live",
    )
    assert out.returncode == 0, out.stderr
    m = STATS.search(out.stdout)
    assert m, out.stdout
    assert int(m.group(1)) <= 8 and float(m.group(2)) >= 2.0
    assert "░" not in out.stdout


@pytest.mark.slow
def test_live_canvas_on_a_terminal(ckpt):
    """On a TTY the canvas is drawn with masked cells and redrawn in place as it fills in."""
    args = ["generate", "--model", str(ckpt), "--prompt", "hello", "--max-tokens", "48"]
    pid, fd = cli_on_pty(*args, "--block-length", "16", "--steps", "16")
    screen = read_pty(fd, pid)
    assert "░" in screen, "no masked cells were drawn"
    assert "\x1b[" in screen and "F\x1b[J" in screen, "the canvas was not redrawn in place"
    assert STATS.search(screen)


@pytest.mark.slow
def test_unknown_setting_is_a_clear_error(ckpt):
    out = run_cli("generate", "--model", str(ckpt), "--prompt", "hi", "--alg", "entropy")
    assert out.returncode != 0
    assert "unknown setting(s) alg for the llada family" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_bad_value_is_a_clear_error(ckpt):
    out = run_cli("generate", "--model", str(ckpt), "--prompt", "hi", "--steps", "0")
    assert out.returncode != 0 and "steps must be an integer >= 1" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_missing_checkpoint_is_a_clear_error(tmp_path):
    out = run_cli("generate", "--model", str(tmp_path / "none"), "--prompt", "hi")
    assert out.returncode != 0 and "no checkpoint at" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_convert_delegates_to_mlx_lm(ckpt, tmp_path):
    out = run_cli(
        "convert",
        "--hf-path",
        str(ckpt),
        "--mlx-path",
        str(tmp_path / "q"),
        "-q",
        "--q-bits",
        "8",
        "--q-group-size",
        "32",
    )
    assert out.returncode == 0, out.stderr
    gen = run_cli(
        "generate",
        "--model",
        str(tmp_path / "q"),
        "--prompt",
        "hi",
        "--max-tokens",
        "8",
        "--no-live",
    )
    assert gen.returncode == 0, gen.stderr
    assert STATS.search(gen.stdout)


@pytest.mark.parametrize("name", sorted(__import__("fixtures").all_checkpoints()))
def test_generate_runs_on_every_family(name, tmp_path, capsys):
    """`mlx_dllm generate` on every family's Hugging Face layout, run in this process: the same
    command in a fresh interpreter, on every family's conversion, is
    test_packaging_fresh_convert's (one interpreter start a family instead of two)."""
    from fixtures import all_checkpoints
    from mlx_dllm_models.cli import main

    path = all_checkpoints()[name](tmp_path / name)
    code = main(
        ["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "8", "--no-live"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert STATS.search(out.out), out.out
