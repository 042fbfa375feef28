"""Every code block of README.md runs, as a user would paste it: the commands in a shell, the
Python in a fresh interpreter. The one real checkpoint it names (a Hub id) is replaced by a tiny
LLaDA checkpoint in the exact Hugging Face layout, and the server's port by a free one; nothing else
in a block is changed. The install commands are not re-run (the suite runs after that install):
their text is checked against what .ci/run installs and runs."""

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fixtures import build_once
from fixtures.llada import build_llada

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.S)
HUB_ID = "GSAI-ML/LLaDA-8B-Instruct"
INSTALL = "python -m pip install '.[cpu]' && "
TEST_INSTALL = "python -m pip install -e '.[test]' && "


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _shell(script, cwd, timeout=600):
    """bash running `script` with `python` and `mlx_dllm` bound to this interpreter and checkout."""
    prelude = (
        f'python() {{ "{sys.executable}" "$@"; }}\n'
        f'mlx_dllm() {{ "{sys.executable}" -m mlx_dllm_models "$@"; }}\n'
        "set -e\n"
    )
    return subprocess.run(
        ["bash", "-c", prelude + script],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _python(code, cwd):
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _blocks(lang, containing):
    found = [body for kind, body in BLOCKS if kind == lang and containing in body]
    assert found, f"no {lang} block of README.md holds {containing!r}"
    return found


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_readme_is_a_front_page():
    lines = README.splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:40])
    for what in (INSTALL.strip(" &"), "mlx_dllm generate", HUB_ID, "generate_diffusion("):
        assert what in head, what
    table = [line for line in lines if line.startswith("| [")]
    assert len(table) >= 17 and all(len(line) < 300 for line in table)
    for link in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link


@pytest.mark.slow
def test_first_generation_with_the_embedded_default(tmp_path):
    (block,) = _blocks("bash", INSTALL)
    command = block.split("#")[0].strip()
    assert command.startswith(INSTALL)
    out = _ok(_shell(command[len(INSTALL) :], tmp_path))
    assert "132" in out


def test_the_test_command_is_what_ci_runs():
    (block,) = _blocks("bash", TEST_INSTALL)
    command = block.split("   #")[0].strip()
    assert command == (ROOT / ".ci" / "TEST_COMMAND.txt").read_text().strip()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The README's convert-and-generate block, on the tiny LLaDA for the Hub id; its folder."""
    source = build_once(tmp_path_factory.mktemp("hub") / "llada", build_llada)
    cwd = tmp_path_factory.mktemp("readme")
    (block,) = _blocks("bash", HUB_ID)
    out = _ok(_shell(block.replace(HUB_ID, str(source)), cwd))
    assert out.strip(), "the generation printed nothing"
    return cwd


@pytest.mark.slow
def test_python_example(converted):
    (code,) = _blocks("python", "batch_generate_diffusion")
    out = _ok(_python(code, converted))
    assert out.strip()


@pytest.mark.slow
def test_help_and_settings_commands(converted):
    (block,) = _blocks("bash", "mlx_dllm --help")
    out = _ok(_shell(block, converted, timeout=300))
    assert "generate" in out and "serve" in out


@pytest.mark.slow
def test_serve_example(converted):
    from helpers import free_port

    (block,) = _blocks("bash", "mlx_dllm serve")
    port = str(free_port())
    serve, curl = block.replace("8080", port).split("&\n", 1)
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_dllm_models", *serve.split()[1:]],
        cwd=converted,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        assert '"content"' in _ok(_shell(curl, converted))
        (client,) = _blocks("python", "OpenAI(")
        assert _ok(_python(client.replace("8080", port), converted)).strip()
    finally:
        server.terminate()
        server.wait(timeout=60)
