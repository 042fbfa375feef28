"""The wheel built from this checkout and a throwaway venv holding a regular (non-editable)
install of it, for the packaging tests' fresh processes that never imported mlx_dllm_models.

Test modules load this file as a pytest plugin (`pytest_plugins = ["installed_wheel"]`, and never
import it), so its session fixtures `wheel` and `installed` are built once however many modules
use them.

In the venv, `mlx_dllm_models.pth` is processed by `site` at start-up exactly as in a user's
environment (a .pth on PYTHONPATH would be ignored). The venv sees the test environment's packages
(mlx, mlx-lm, ...) through a start-up `site.addsitedir` of its own, so nothing is downloaded and
nothing is copied.
"""

import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from fresh_process import ROOT, run_checked


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    run_checked(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            out,
            ROOT,
        ],
        out,
    )
    (whl,) = out.glob("mlx_dllm_models-*.whl")
    return whl


@pytest.fixture(scope="session")
def installed(tmp_path_factory, wheel):
    """A venv with the wheel installed the regular way, on top of the test environment's packages."""
    base = tmp_path_factory.mktemp("venv")
    venv = base / "venv"
    run_checked([sys.executable, "-m", "venv", "--without-pip", venv], base)
    python = venv / "bin" / "python"
    site_dir = Path(
        run_checked(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], base
        ).stdout.strip()
    )
    parents = [
        p
        for p in dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
        if Path(p).is_dir()
    ]
    # Sorts before mlx_dllm_models.pth, so the dependencies are importable when the hook loads.
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    # Without torch, as a user's install (torch is the tests' reference only; tests/no_torch).
    lines += "import sys; sys.modules.setdefault('torch', None)\n"
    (site_dir / "_test_parent_env.pth").write_text(lines)
    # The test environment's pip, so that nothing outside the throwaway venv is touched.
    run_checked(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            site_dir,
            wheel,
        ],
        base,
    )
    workdir = base / "work"
    workdir.mkdir()
    return SimpleNamespace(python=python, site=site_dir, workdir=workdir)
