"""Packaging: the wheel's files and metadata, the editable wheel, the start-up hook it installs,
the entry points, and the upstream patch with which mlx-lm finds our models through the entry
points alone, in a fresh process of the throwaway venv (tests/installed_wheel.py) that never
imported mlx_dllm_models."""

import importlib.metadata
import json
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from fresh_process import ROOT, clean_env, run_checked
from mlx_dllm_models.registry import MODEL_TYPES

# The session's wheel and its throwaway venv (fixtures `wheel`, `installed`), built once for
# every module that loads them.
pytest_plugins = ["installed_wheel"]

PATCH = ROOT / "patches" / "mlx-lm-model-plugins.patch"
PINNED_MLX_LM = "0.32.2"
HEAVY = ("mlx", "mlx_lm", "mlx_vlm", "numpy", "transformers", "torch", "mlx_dllm_models")
# Wheels built and installed into fresh environments: the full command's, not the quick loop's.
pytestmark = pytest.mark.slow


def _python(installed, code, *args, extra_env=None, timeout=600):
    """Run `code` in a fresh interpreter of the throwaway venv, outside the checkout; return what it
    printed on its `RESULT ` line, parsed as JSON."""
    env = clean_env()
    env.update(extra_env or {})
    proc = run_checked(
        [installed.python, "-c", textwrap.dedent(code), *args], installed.workdir, env, timeout
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no RESULT line:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="session")
def mlx_lm_copy(tmp_path_factory):
    """A copy of the installed mlx_lm package, for the patch."""
    import mlx_lm

    version = importlib.metadata.version("mlx-lm")
    if version != PINNED_MLX_LM:
        pytest.skip(f"{PATCH.name} targets mlx-lm {PINNED_MLX_LM}; installed is {version}")
    dst = tmp_path_factory.mktemp("mlx_lm_src")
    shutil.copytree(
        Path(mlx_lm.__file__).parent, dst / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dst


def _apply_patch(directory, check):
    """Apply (or with `check`, only try) the patch in `directory`; (ok, output)."""
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "-i", str(PATCH)] + (["--dry-run"] if check else [])
    else:
        cmd = ["git", "apply", str(PATCH)] + (["--check"] if check else [])
    proc = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
    # patch's "Hunk #1 succeeded at ... (offset/fuzz)" means it no longer matches the sources exactly.
    return proc.returncode == 0 and "Hunk" not in proc.stdout, proc.stdout + proc.stderr


def test_patch_applies_cleanly_to_pinned_mlx_lm(mlx_lm_copy):
    ok, output = _apply_patch(mlx_lm_copy, check=True)
    assert ok, output


def test_entry_points_declare_every_registered_model_type():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["mlx_lm.models"]
    assert declared == {t: f"mlx_dllm_models.models.{m}" for t, m in MODEL_TYPES.items()}


def test_wheel_ships_the_startup_hook_at_its_root(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        assert whl.read("mlx_dllm_models.pth").decode().strip() == "import mlx_dllm_models_hook"
    assert {
        "mlx_dllm_models_hook.py",
        "mlx_dllm_models/__init__.py",
        "mlx_dllm_models/registry.py",
    } <= names
    assert not any(n.startswith(("tests/", "patches/")) for n in names)


def test_linux_backends_are_extras_as_in_mlx_lm(wheel):
    """Issue 15 §5: the wheel's metadata leaves MLX's Linux backend to an extra ([cpu], [cuda12],
    [cuda13], mlx-lm's names), so a CUDA user is not forced onto mlx[cpu] (the two install the
    same files); the README names the command for each platform."""
    import email

    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(name))
    requires = [r.replace(" ", "").replace('"', "'") for r in meta.get_all("Requires-Dist")]
    assert {"cpu", "cuda12", "cuda13"} <= set(meta.get_all("Provides-Extra"))
    base = [r for r in requires if "extra==" not in r]
    assert any(r.startswith("mlx>=") for r in base), base
    assert not any(r.startswith("mlx[") for r in base), base  # no backend without an extra
    for extra in ("cpu", "cuda12", "cuda13"):
        assert any(r.startswith(f"mlx[{extra}]") and f"extra=='{extra}'" in r for r in requires)
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].splitlines()[0]
    assert first.startswith("python -m pip install '.[cpu]' && mlx_dllm generate"), first
    assert "'.[cuda12]'" in readme and "'.[cuda13]'" in readme


def test_editable_wheel_also_ships_the_startup_hook(tmp_path):
    """`pip install -e .` must install the hook too, after the .pth that puts the checkout on sys.path."""
    code = f"from hatchling.build import build_editable; print(build_editable({str(tmp_path)!r}))"
    name = run_checked([sys.executable, "-c", code], ROOT).stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(tmp_path / name) as whl:
        pths = sorted(n for n in whl.namelist() if n.endswith(".pth"))
        assert whl.read("mlx_dllm_models.pth").decode().strip() == "import mlx_dllm_models_hook"
        paths = [whl.read(n).decode().strip() for n in pths if n != "mlx_dllm_models.pth"]
    # site processes .pth files in sorted order.
    assert pths[-1] == "mlx_dllm_models.pth" and paths == [str(ROOT)], pths


def test_startup_hook_is_installed_and_imports_nothing_heavy(installed):
    got = _python(
        installed,
        f"""
        import json, sys
        hook = sys.modules.get("mlx_dllm_models_hook")
        print("RESULT", json.dumps({{
            "hook_file": getattr(hook, "__file__", None),
            "finders": [type(f).__name__ for f in sys.meta_path],
            "heavy": sorted(m for m in {HEAVY!r} if sys.modules.get(m) is not None),
        }}))
        """,
    )
    assert got["hook_file"] is not None, "mlx_dllm_models.pth did not run at start-up"
    assert Path(got["hook_file"]).parent == installed.site, got["hook_file"]
    assert "DiffusionModelFinder" in got["finders"]
    assert got["heavy"] == []


def _available_model_types():
    import importlib.util

    return {
        t: m
        for t, m in MODEL_TYPES.items()
        if importlib.util.find_spec(f"mlx_dllm_models.models.{m}")
    }


def test_patched_mlx_lm_finds_models_through_entry_points_alone(installed, mlx_lm_copy, tmp_path):
    types = _available_model_types()
    if not types:
        pytest.skip("no model module written yet")
    patched = tmp_path / "patched"
    shutil.copytree(mlx_lm_copy, patched)
    ok, output = _apply_patch(patched, check=False)
    assert ok, output
    got = _python(
        installed,
        f"""
        import importlib.util, json, sys
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "DiffusionModelFinder"]
        import mlx_lm.utils as utils
        out = {{"utils": utils.__file__, "classes": {{}}}}
        for t in {sorted(types)!r}:
            assert importlib.util.find_spec("mlx_lm.models." + t) is None, "hook still active"
            model, args = utils._get_classes({{"model_type": t}})
            out["classes"][t] = [model.__module__, args.__module__]
        try:
            utils._get_classes({{"model_type": "no_such_model_type"}})
        except ValueError as e:
            out["unknown"] = str(e)
        print("RESULT", json.dumps(out))
        """,
        extra_env={"PYTHONPATH": str(patched)},
    )
    assert Path(got["utils"]).is_relative_to(patched)
    assert got["classes"] == {t: [f"mlx_dllm_models.models.{m}"] * 2 for t, m in types.items()}
    assert "not supported" in got["unknown"]
