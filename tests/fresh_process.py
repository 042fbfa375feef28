"""How the packaging tests run a command in a fresh process: an environment free of this
interpreter's PYTHON* variables and offline, and the command run to a zero exit."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def clean_env():
    """A fresh interpreter's environment: none of this one's PYTHON* variables, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_checked(cmd, cwd, env=None, timeout=600):
    """`cmd` run to its end in `cwd`; its CompletedProcess, once it exited 0."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc
