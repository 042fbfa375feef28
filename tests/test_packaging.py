"""Packaging: the wheel, the start-up hook, the upstream patch, and mlx-lm finding our models in
fresh processes that never imported mlx_dllm_models.

The fresh processes run in a throwaway venv holding a regular (non-editable) install of the wheel
built from this checkout, so `mlx_dllm_models.pth` is processed by `site` at start-up exactly as
in a user's environment (a .pth on PYTHONPATH would be ignored). The venv sees the test
environment's packages (mlx, mlx-lm, ...) through a start-up `site.addsitedir` of its own, so
nothing is downloaded and nothing is copied.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlx_dllm_models.registry import MODEL_TYPES
from tests.fixtures import all_checkpoints

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "mlx-lm-model-plugins.patch"
PINNED_MLX_LM = "0.32.2"
HEAVY = ("mlx", "mlx_lm", "mlx_vlm", "numpy", "transformers", "torch", "mlx_dllm_models")
# Wheels built and installed into fresh environments: the full command's, not the quick loop's.
pytestmark = pytest.mark.slow


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _run(cmd, cwd, env=None, timeout=600):
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _python(installed, code, *args, extra_env=None, timeout=600):
    """Run `code` in a fresh interpreter of the throwaway venv, outside the checkout; return what it
    printed on its `RESULT ` line, parsed as JSON."""
    env = _env()
    env.update(extra_env or {})
    proc = _run(
        [installed.python, "-c", textwrap.dedent(code), *args], installed.workdir, env, timeout
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no RESULT line:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    _run(
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
    _run([sys.executable, "-m", "venv", "--without-pip", venv], base)
    python = venv / "bin" / "python"
    site_dir = Path(
        _run(
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
    _run(
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
    name = _run([sys.executable, "-c", code], ROOT).stdout.strip().splitlines()[-1]
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


# `python -m mlx_lm convert` (run as __main__, as the CLI does) plain, -q 4 bit and -q 8 bit, of
# every family's checkpoint (arguments: family=src=work), in one fresh interpreter: what was
# imported before mlx-lm needed it, and each family's failure, if any.
CONVERT = """
import json, runpy, sys, traceback
before = sorted(m for m in ("mlx_dllm_models", "mlx", "mlx_lm") if m in sys.modules)
variants = {"plain": [], "q4": ["-q", "--q-bits", "4", "--q-group-size", "32"],
            "q8": ["-q", "--q-bits", "8", "--q-group-size", "32"]}
errors = {}
for arg in sys.argv[1:]:
    family, src, work = arg.split("=", 2)
    try:
        for name, flags in variants.items():
            sys.argv = ["mlx_lm", "convert", "--hf-path", src, "--mlx-path", f"{work}/{name}", *flags]
            runpy.run_module("mlx_lm", run_name="__main__")
    except BaseException:
        errors[family] = traceback.format_exc()[-3000:]
print("RESULT", json.dumps({"before": before, "errors": errors}))
"""

# Then plain `mlx_lm.load` (no tokenizer_config) in a fresh interpreter whose stdin is a terminal,
# for every family (arguments: family=variant=path): of the Hugging Face folder (its auto_map
# kept), of the same folder without auto_map, and of each conversion: each load timed (after one
# untimed load of the family's folder without auto_map, which imports transformers' tokenizer
# modules), a forward, generate_diffusion, and `mlx_dllm generate` of the plain conversion (the
# command's main, in this interpreter).
LOAD_AND_GENERATE = """
import contextlib, io, json, sys, time, traceback
import mlx.core as mx
import mlx_lm
import mlx_dllm_models
from mlx_dllm_models.cli import main as mlx_dllm

families = {}
for arg in sys.argv[1:]:
    family, variant, path = arg.split("=", 2)
    families.setdefault(family, {})[variant] = path
results = {}


def one(paths):
    out = {"package": mlx_dllm_models.__file__, "models": {}}
    mlx_lm.load(paths["hf_bare"])  # the first load also imports transformers' tokenizer modules
    reference = None
    for name, path in paths.items():
        t = time.perf_counter()
        model, tokenizer = mlx_lm.load(path)
        seconds = time.perf_counter() - t
        ids = tokenizer.encode("hello world")
        logits = model(mx.array([ids]))
        mx.eval(logits)
        if reference is None:
            reference = logits.astype(mx.float32)
        diff = mx.abs(logits.astype(mx.float32) - reference).max() / (mx.abs(reference).max() + 1e-6)
        bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits")})
        try:
            text = mlx_dllm_models.generate_diffusion(model, tokenizer, ids, max_tokens=8)
            generated = {"ok": True, "type": type(text).__name__}
        except Exception as e:  # reported, and asserted on by the test
            generated = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out["models"][name] = {
            "seconds": seconds,
            "generated": generated,
            "module": type(model).__module__,
            "ids": len(ids),
            "shape": list(logits.shape),
            "finite": bool(mx.isfinite(logits).all()),
            "rel_diff": float(diff),
            "bits": bits,
        }
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = mlx_dllm(["generate", "--model", paths["plain"], "--prompt", "hello",
                         "--max-tokens", "8", "--no-live"])
    out["cli"] = {"code": code, "stdout": printed.getvalue()}
    return out


for family, paths in families.items():
    try:
        results[family] = one(paths)
    except BaseException:
        results[family] = {"error": traceback.format_exc()[-3000:]}
print("RESULT", json.dumps(results))
"""


# Model types whose decoding loop is not in the engine yet: they convert and load, but generation
# is not asserted. Keep this empty once every family decodes.
DECODING_PENDING = set()

# transformers' question, which would wait 15 s for an answer on a terminal.
PROMPT = "Do you wish to run the custom code"
REMOTE_CODE_RAN = "the remote code ran"


def _remote_code_that_exits(src):
    """The `*.py` files the checkpoint's auto_map names (in config.json and tokenizer_config.json),
    written as code that ends the process: if anything runs them, the load fails."""
    for name in ("config.json", "tokenizer_config.json"):
        file = Path(src) / name
        auto_map = json.loads(file.read_text()).get("auto_map", {}) if file.exists() else {}
        for targets in auto_map.values():
            for target in targets if isinstance(targets, list) else [targets]:
                if target:
                    module = target.split("--")[-1].rsplit(".", 1)[0]
                    (Path(src) / f"{module}.py").write_text(
                        f"raise SystemExit({REMOTE_CODE_RAN!r})\n"
                    )


def _without_auto_map(src, dst):
    """A copy of the checkpoint folder with no auto_map and no remote code: the timing baseline."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py"))
    for name in ("config.json", "tokenizer_config.json"):
        file = dst / name
        if file.exists():
            config = json.loads(file.read_text())
            config.pop("auto_map", None)
            file.write_text(json.dumps(config, indent=2))
    return dst


def _pty_result(installed, code, *args, timeout=600):
    rc, text = _run_on_a_pty(
        [installed.python, "-c", textwrap.dedent(code), *args], installed.workdir, _env(), timeout
    )
    assert rc == 0, text[-4000:]
    assert PROMPT not in text and REMOTE_CODE_RAN not in text, text[-4000:]
    line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"no RESULT line:\n{text[-4000:]}"
    return json.loads(line[len("RESULT ") :]), text


@pytest.fixture(scope="module")
def fresh_runs(installed, tmp_path_factory):
    """Every family's checkpoint converted in one fresh interpreter, then loaded in another (two
    interpreter starts for all families, not two a family): (the families' folders, the convert
    run's result, the load run's result by family)."""
    root = tmp_path_factory.mktemp("fresh")
    folders = {}
    for name, build in sorted(all_checkpoints().items()):
        src = build(root / name / "hf")
        _remote_code_that_exits(src)
        bare = _without_auto_map(Path(src), root / name / "hf_bare")
        work = root / name / "mlx"
        work.mkdir()
        folders[name] = SimpleNamespace(src=Path(src), bare=bare, work=work)
    pairs = [f"{n}={f.src}={f.work}" for n, f in folders.items()]
    converted, _ = _pty_result(installed, CONVERT, *pairs, timeout=1800)
    args = []
    for n, f in folders.items():
        paths = [("hf", f.src), ("hf_bare", f.bare)]
        paths += [(v, f.work / v) for v in ("plain", "q4", "q8")]
        args += [f"{n}={v}={p}" for v, p in paths if n not in converted["errors"] or v[:2] == "hf"]
    loaded, _ = _pty_result(installed, LOAD_AND_GENERATE, *args, timeout=1800)
    return folders, converted, loaded


@pytest.mark.parametrize("name", sorted(all_checkpoints()))
def test_mlx_lm_converts_and_loads_and_generates_in_a_fresh_process(name, installed, fresh_runs):
    """Issue 25 §1, the main path: `python -m mlx_lm convert` (with and without -q) of the
    Hugging Face layout, then plain `mlx_lm.load` in a fresh interpreter on a terminal: no
    question about remote code, none run, no wait (each load within 1 s of the same checkpoint
    without auto_map), and `mlx_dllm generate` on the result. (All families share the two
    interpreters: fresh_runs.)"""
    folders, converted, loaded = fresh_runs
    src, work = folders[name].src, folders[name].work
    model_type = json.loads((src / "config.json").read_text())["model_type"]
    assert converted["before"] == [], "the interpreter imported these before mlx-lm needed them"
    assert name not in converted["errors"], converted["errors"].get(name)
    variants = ("plain", "q4", "q8")
    for variant in variants:
        out = work / variant
        # The start-up hook's mlx_lm.utils.save: no remote code in the output, our model card.
        for file in ("config.json", "tokenizer_config.json"):
            assert "auto_map" not in json.loads((out / file).read_text()), (variant, file)
        assert not list(out.glob("*.py")), f"{variant}: the remote code was copied"
        assert "mlx_dllm generate --model" in (out / "README.md").read_text(), variant

    got = loaded[name]
    assert "error" not in got, got.get("error")

    assert Path(got["package"]).is_relative_to(installed.site), "not the installed wheel"
    expected_module = f"mlx_dllm_models.models.{MODEL_TYPES[model_type]}"
    hf = got["models"]["hf"]
    for variant, m in got["models"].items():
        assert m["module"] == expected_module, variant
        assert m["shape"][:2] == [1, m["ids"]] and m["shape"][2] == hf["shape"][2], variant
        assert m["finite"], variant
        if model_type not in DECODING_PENDING:
            assert m["generated"] == {"ok": True, "type": "str"}, (variant, m["generated"])
    # No wait: every load within 1 s of the folder without auto_map (each takes well under 1 s).
    baseline = got["models"]["hf_bare"]["seconds"]
    seconds = {v: round(m["seconds"], 3) for v, m in got["models"].items()}
    assert all(s < baseline + 1.0 for s in seconds.values()), seconds
    # The plain conversion keeps the weights (up to the dtype cast convert applies from torch_dtype).
    assert got["models"]["plain"]["bits"] == [] and got["models"]["plain"]["rel_diff"] < 1e-2
    assert 4 in got["models"]["q4"]["bits"], "-q --q-bits 4 quantized nothing"
    assert 8 in got["models"]["q8"]["bits"], "-q --q-bits 8 quantized nothing"
    if model_type not in DECODING_PENDING:
        assert got["cli"]["code"] == 0 and "NFE:" in got["cli"]["stdout"], got["cli"]


# ------------------------------------------------------------- mlx-lm's own tools (issue 15 §2)


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "What is 47+85?"],
        ["cache_prompt", "--prompt", "What is 47+85?", "--prompt-cache-file", "cache.safetensors"],
    ],
    ids=lambda c: c[0],
)
def test_mlx_lm_tools_refuse_a_masked_diffusion_checkpoint_with_a_pointer(installed, command):
    """`python -m mlx_lm generate` would decode the embedded default (a LLaDA) token by token and
    print an empty answer; it must stop before any forward pass and name our command."""
    default = installed.site / "mlx_dllm_models" / "assets" / "default"
    assert (default / "config.json").exists()
    proc = subprocess.run(
        [installed.python, "-m", "mlx_lm", command[0], "--model", default, *command[1:]],
        cwd=installed.workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, proc.stdout
    assert "NotAutoregressiveError" in proc.stderr and "mlx_dllm generate" in proc.stderr, (
        proc.stderr[-2000:]
    )
    assert "Generation:" not in proc.stdout  # mlx-lm's statistics: nothing was generated
    assert not (installed.workdir / "cache.safetensors").exists()


def _lora_data(directory):
    """A completions jsonl in mlx-lm's layout (train.jsonl, valid.jsonl, test.jsonl)."""
    directory.mkdir()
    rows = [{"prompt": f"What is {a}-{b}?", "completion": str(a - b)} for a, b in [(50, 20)] * 4]
    for name in ("train", "valid", "test"):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _mlx_lm_lora(installed, module, model, data, adapters, *flags):
    return subprocess.run(
        [installed.python, "-m", *module, "--model", model, "--data", data]
        + ["--adapter-path", adapters, "--batch-size", "2", "--num-layers", "1", *flags],
        cwd=installed.workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "module, flags",
    [
        (["mlx_lm", "lora"], ["--train", "--iters", "1"]),
        (["mlx_lm.lora"], ["--train", "--iters", "1"]),  # runs lora.py as __main__
        (["mlx_lm", "lora"], ["--test", "--adapter-path", ""]),  # the next-token test loss
    ],
    ids=["python -m mlx_lm lora", "python -m mlx_lm.lora", "lora --test"],
)
def test_mlx_lm_lora_refuses_a_diffusion_checkpoint_with_a_pointer(
    installed, tmp_path, module, flags
):
    """mlx_lm.lora would fit the embedded default (a LLaDA) with the next-token loss; the start-up
    hook's guard on mlx-lm's trainer stops it before the first step and names `mlx_dllm lora`."""
    default = installed.site / "mlx_dllm_models" / "assets" / "default"
    adapters = tmp_path / "adapters"
    proc = _mlx_lm_lora(installed, module, default, _lora_data(tmp_path / "data"), adapters, *flags)
    assert proc.returncode != 0, proc.stdout
    error = "mlx_dllm_models.models.common.NotAutoregressiveError: llada is a diffusion model"
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith(error)] or [proc.stderr]
    assert line.startswith(error) and "`mlx_dllm lora" in line, proc.stderr[-2000:]
    assert not (adapters / "adapters.safetensors").exists()


def _tiny_llama(path):
    """A plain mlx-lm llama checkpoint (no diffusion), with the default's byte-level tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path.mkdir()
    config = dict(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=264,
        tie_word_embeddings=True,
    )
    (path / "config.json").write_text(json.dumps(config))
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    default = ROOT / "mlx_dllm_models" / "assets" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default / name, path / name)
    return path


def _nemotron(path):
    from tests.fixtures.nemotron import build

    return build(path)


@pytest.mark.parametrize("build", [_tiny_llama, _nemotron], ids=["llama", "nemotron"])
def test_mlx_lm_lora_still_trains_autoregressive_models(installed, tmp_path, build):
    """The guard leaves mlx-lm's own models alone, and Nemotron-Labs-Diffusion, which is also an
    autoregressive model (mlx-lm's generate runs it): the next-token loss trains that mode."""
    model = build(tmp_path / "model")
    adapters = tmp_path / "adapters"
    data = _lora_data(tmp_path / "data")
    proc = _mlx_lm_lora(
        installed, ["mlx_lm", "lora"], model, data, adapters, "--train", "--iters", "1"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (adapters / "adapters.safetensors").exists()


# A child on a pseudo-terminal: transformers' "Do you wish to run the custom code? [y/N]" would
# wait 15 s for an answer there. The load alone is timed, after the imports.
PTY_LOAD = """
import json, sys, time
import mlx_lm
t = time.perf_counter()
model, tokenizer = mlx_lm.load(sys.argv[1])
print("RESULT", json.dumps({"seconds": time.perf_counter() - t, "module": type(model).__module__}))
"""


def _run_on_a_pty(cmd, cwd, env, timeout=120):
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    os.close(follower)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        # Drain whatever the child wrote to the terminal itself, then close it.
        while select.select([leader], [], [], 0)[0]:
            try:
                if not os.read(leader, 4096):
                    break
            except OSError:
                break
        os.close(leader)
    return proc.returncode, out.decode(errors="replace")


def test_converted_checkpoint_loads_in_plain_mlx_lm_without_prompt_or_remote_code(
    installed, tmp_path
):
    from tests.fixtures.llada import build_llada

    src = build_llada(tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    assert "AutoConfig" in config["auto_map"], "the fixture must carry auto_map as real ones do"
    # The remote code the auto_map names: running it would end the process.
    for name in ("configuration_llada.py", "modeling_llada.py"):
        (src / name).write_text("raise SystemExit('the remote code ran')\n")
    out = tmp_path / "mlx"
    _run(
        [installed.python, "-m", "mlx_dllm_models", "convert", "--hf-path", src, "--mlx-path", out],
        installed.workdir,
    )

    assert "auto_map" not in json.loads((out / "config.json").read_text())
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    assert not list(out.glob("*.py")), "the remote code was copied into the output"
    card = (out / "README.md").read_text()
    assert "mlx_dllm generate --model" in card and "library_name: mlx" in card

    rc, text = _run_on_a_pty([installed.python, "-c", PTY_LOAD, out], installed.workdir, _env())
    assert rc == 0, text
    assert "Do you wish to run the custom code" not in text and "remote code ran" not in text
    got = json.loads(next(ln for ln in text.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["module"] == "mlx_dllm_models.models.llada"
    assert got["seconds"] < 5, got
