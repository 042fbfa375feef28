"""The CLI explains itself: `mlx_dllm --help` lists the commands, `generate --help` groups its
flags, on/off settings take `--x` / `--no-x`, fixed values are choices, a misspelt flag or value is
refused before anything loads (with a suggestion), `evaluate --help` needs no lm-eval, `lora` and
`convert` without arguments print their usage, weights are read with a progress bar on a terminal,
and `mlx_dllm settings` shows each value a run would use and where it came from."""

import io
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from helpers import cli_env, run_cli
from mlx_dllm_models import load
from mlx_dllm_models.cli import COMMANDS, generate_parser
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.cli_common import fixed_values, setting_groups
from mlx_dllm_models.decoding.samplers import COMMIT_RULES
from mlx_dllm_models.engine.registry import BACKENDS, DECODERS
from mlx_dllm_models.request import prepare
from mlx_dllm_models.settings import (
    FAMILY_SAMPLERS,
    SETTINGS,
    resolve_settings,
    resolve_with_origins,
)
from mlx_dllm_models.spec import BLOCK_CAUSAL, SHARED_SAMPLERS, DiffusionSpec
from mlx_dllm_models.tiny import build_tiny_llada

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = build_tiny_llada(tmp_path_factory.mktemp("cli_help") / "llada")
    gen = json.loads((path / "generation_config.json").read_text())
    # A value the checkpoint sets, so that the settings command has one to attribute to it.
    (path / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 24}))
    return path


def flag(name):
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------------------ the help


def test_top_level_help_lists_every_command_with_a_line():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    assert set(COMMANDS) >= {"generate", "chat", "serve", "convert", "lora", "fuse", "evaluate"}
    assert "settings" in COMMANDS
    for name, (line, _) in COMMANDS.items():
        shown = re.search(rf"^\s+{name}\s+(\S.*)$", out.stdout, re.M)
        assert shown and shown.group(1).strip() == line, (name, out.stdout)
    # No command: the same list, on stderr, exit 2.
    bare = run_cli()
    assert bare.returncode == 2 and "generate" in bare.stderr and "settings" in bare.stderr


def test_the_command_list_imports_no_mlx():
    code = (
        "import sys\nfrom mlx_dllm_models.cli import main\nassert main(['--help']) == 0\n"
        "print(sorted(m for m in ('mlx', 'mlx_lm', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_misspelt_command_is_refused_with_a_suggestion(capsys):
    assert cli_main(["genrate"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'genrate'" in err and "did you mean generate?" in err


def help_sections(text):
    """Section title -> its text, of argparse's help."""
    sections, title = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def test_generate_help_groups_the_settings():
    text = generate_parser().format_help()
    sections = help_sections(text)
    groups = setting_groups()
    titles = [title for title, _ in groups]
    assert titles[:3] == ["common settings", "sampler settings", "cache"]
    # Every family has its group, and every row sits in the group of its families.
    families = {f for s in SETTINGS for f in s.families}
    assert families <= {f for t in titles[3:] for f in t.removesuffix(" settings").split(" / ")}
    for title, rows in groups:
        for s in rows:
            assert re.search(rf"^  {flag(s.name)}\b", sections[title], re.M), (s.name, title)
            if s.families:
                assert title == f"{' / '.join(s.families)} settings"
    # The groups follow the flags that are not settings, in this order.
    starts = [text.index(f"\n{t}:\n") for t in titles]
    assert starts == sorted(starts) and text.index("--prompt") < starts[0]


def test_on_off_settings_take_flags_and_values():
    parse = generate_parser().parse_args
    on_off = [s.name for s in SETTINGS if s.cli_type.__name__ == "cli_bool"]
    assert {"early_stop", "logits_eos_inf", "causal_context"} <= set(on_off)
    for name in on_off:
        assert getattr(parse([flag(name)]), name) is True
        assert getattr(parse(["--no-" + flag(name)[2:]]), name) is False
        assert getattr(parse([flag(name), "false"]), name) is False
        assert getattr(parse([flag(name), "yes"]), name) is True
        assert getattr(parse([]), name) is None
    help_text = generate_parser().format_help()
    assert "--no-early-stop" in help_text and "--early-stop [BOOL]" in help_text


def test_fixed_values_are_choices_from_their_tables():
    fixed = fixed_values()
    loops = {n for d in DECODERS.values() for n in d.samplers}
    assert set(fixed["sampler"]) == set(COMMIT_RULES) | set(FAMILY_SAMPLERS) | loops
    assert {"wedlm", "dream", "dimple", "rnd1", "bd3lm"} <= set(fixed["sampler"])
    assert set(fixed["cache"]) == {"auto"} | {c for row in BACKENDS.values() for c in row}
    assert fixed["editing_mode"] == ("quality", "speed", "off") and "shift" in fixed["schedule"]
    # Without white space: argparse wraps the help at hyphens too (origin-ratio).
    help_text = "".join(generate_parser().format_help().split())
    for name, values in fixed.items():
        assert f"{flag(name)}NAME" in help_text and "oneof:" + ",".join(values) in help_text
        assert generate_parser().parse_args([flag(name), values[-1]]).__dict__[name] == values[-1]
    sampler_help = help_sections(generate_parser().format_help())["sampler settings"]
    for name in fixed["sampler"]:
        assert re.search(rf"\b{name}\b", sampler_help), name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tmep", "0.5"], "unrecognized arguments: --tmep 0.5 (did you mean: --tmep -> --temp?)"),
        (["--block-lenght=8"], "--block-lenght -> --block-length"),
        (["--sampler", "qota"], "unknown sampler 'qota'; choose one of: quota, threshold"),
        (["--cache", "prefx"], "did you mean prefix?"),
        (["--editing-mode", "quick"], "unknown editing_mode 'quick'"),
        (["--early-stop", "maybe"], "expected true or false, got 'maybe'"),
        (["--no-early-stop", "1"], "unrecognized arguments: 1"),
    ],
)
def test_bad_flags_are_refused_before_loading(argv, message, monkeypatch, capsys):
    import mlx_dllm_models.loader as loader

    def never(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(loader, "load", never)
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: mlx_dllm generate" in err


def test_a_misspelt_flag_fails_fast_in_a_fresh_process(tmp_path):
    """The checkpoint named is not there: had the flag passed, the error would say so. The loader
    (and so mlx-lm, transformers) is never imported: what keeps the refusal to well under 2 s."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mlx_dllm_models", "generate"]
        + ["--model", str(tmp_path / "none"), "--tmep", "0.5"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 2 and "did you mean: --tmep -> --temp?" in out.stderr
    assert "no checkpoint" not in out.stderr and "Traceback" not in out.stderr
    imported = re.findall(r"^import time:.*\| +(\S+)$", out.stderr, re.M)
    assert "mlx_dllm_models.cli" in imported
    assert not {"mlx_dllm_models.loader", "mlx_lm", "transformers"} & set(imported)


# ----------------------------------------------------------------------- commands without extras


def test_evaluate_help_without_lm_eval(tmp_path):
    """lm-eval hidden as tests/no_torch hides torch: the help and the flag errors still work, and
    running says what to install."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\nsys.modules['lm_eval'] = None\nsys.modules.setdefault('torch', None)\n"
    )
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)])

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "mlx_dllm_models", "evaluate", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )

    shown = run("--help")
    assert shown.returncode == 0, shown.stderr
    assert "--tasks" in shown.stdout and "pip install 'mlx-dllm-models[eval]'" in shown.stdout
    missing = run("--tasks", "arc_easy")
    assert missing.returncode == 1 and "needs lm-evaluation-harness" in missing.stderr
    assert "Traceback" not in missing.stderr
    typo = run("--tasks", "arc_easy", "--limt", "3")
    assert typo.returncode == 2 and "--limt -> --limit" in typo.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, usage, why",
    [
        ("lora", "usage: mlx_dllm lora", "no arguments: give --train --data DIR"),
        ("convert", "usage: mlx_dllm convert", "--hf-path is required"),
    ],
)
def test_lora_and_convert_without_arguments_print_usage(command, usage, why):
    out = run_cli(command, timeout=120)
    assert out.returncode == 2, out.stderr
    assert usage in out.stderr and why in out.stderr and "Traceback" not in out.stderr


# --------------------------------------------------------------------------------- loading


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_weights_are_read_with_a_progress_bar_on_a_terminal(ckpt, monkeypatch):
    from mlx_dllm_models.loader import read_weights

    eager, _ = load(ckpt)
    expected = dict(tree_flatten(eager.parameters()))
    for stream, shown in ((Tty(), True), (io.StringIO(), False)):
        model, _ = load(ckpt, lazy=True)
        monkeypatch.setattr(sys, "stderr", stream)
        read_weights(model, delay=0)
        got = dict(tree_flatten(model.parameters()))
        assert got.keys() == expected.keys()
        assert all(mx.array_equal(got[k], expected[k]).item() for k in got)
        assert ("loading" in stream.getvalue() and "B" in stream.getvalue()) == shown
    # The bar waits: a load shorter than its delay prints nothing.
    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    read_weights(load(ckpt, lazy=True)[0])
    assert quiet.getvalue() == ""


def test_a_setting_the_family_does_not_take_is_refused_before_the_weights_are_read(
    ckpt, monkeypatch, capsys
):
    import mlx_dllm_models.loader as loader

    read = []
    monkeypatch.setattr(loader, "read_weights", lambda model, **kw: read.append(model))
    with pytest.raises(SystemExit, match="unknown setting\\(s\\) alg for the llada family"):
        cli_main(["generate", "--model", str(ckpt), "--alg", "entropy", "--no-live"])
    assert read == []
    assert cli_main(["generate", "--model", str(ckpt), "-m", "8", "--no-live"]) == 0
    assert len(read) == 1 and "NFE" in capsys.readouterr().out


# ------------------------------------------------------------------------------ settings


def test_resolution_says_where_each_value_came_from():
    from mlx_dllm_models.models.llada2_moe import SETTINGS as LLADA2_ROWS

    spec = DiffusionSpec(
        family="llada2",
        attention=BLOCK_CAUSAL,
        mask_token_id=0,
        settings=LLADA2_ROWS,
        samplers=SHARED_SAMPLERS,
        defaults={"block_length": 32, "editing_mode": "quality"},
        sampler_defaults={"threshold": {"threshold": 0.8}},
        presets={"editing_mode": {"quality": {"editing_threshold": 0.9, "max_post_steps": 4}}},
    )
    checkpoint = {"max_tokens": 64, "top_p": None}
    explicit = {"sampler": "threshold", "seed": 3}
    values, origins = resolve_with_origins(spec, explicit, checkpoint)
    assert values == resolve_settings(spec, explicit, checkpoint)
    assert origins.keys() == values.as_dict().keys()
    assert origins["sampler"] == origins["seed"] == "explicit"
    assert (values.max_tokens, origins["max_tokens"]) == (64, "checkpoint")
    assert (values.threshold, origins["threshold"]) == (0.8, "sampler threshold")
    assert (
        origins["editing_threshold"] == origins["max_post_steps"] == "preset editing_mode=quality"
    )
    assert origins["editing_mode"] == origins["block_length"] == "family"
    assert (values.steps, origins["steps"]) == (32, "from block_length")
    assert origins["top_p"] == origins["cache"] == "package"
    # The explicit value beats the preset's; no block_length anywhere: one block of max_tokens.
    one_block = replace(spec, defaults={"block_length": None, "editing_mode": "quality"})
    values, origins = resolve_with_origins(one_block, {"editing_threshold": 0.5}, {})
    assert (values.editing_threshold, origins["editing_threshold"]) == (0.5, "explicit")
    assert (values.block_length, origins["block_length"]) == (128, "from max_tokens")


def settings_rows(text):
    """setting -> (value, origin) of `mlx_dllm settings`' table."""
    table = text.split("\n\n")[0].splitlines()[2:]
    return {r.split()[0]: (r.split()[1], " ".join(r.split()[2:])) for r in table}


def test_settings_command_shows_what_generate_would_use(ckpt, capsys):
    argv = ["--sampler", "threshold", "--threshold", "0.7", "--temp", "0.5", "--block-length", "8"]
    assert cli_main(["settings", "--model", str(ckpt), *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{ckpt}: the llada family\n")
    rows = settings_rows(out)
    model, tok = load(ckpt)
    chosen = dict(sampler="threshold", threshold=0.7, temperature=0.5, block_length=8)
    used = prepare(model, tok, ["hi"], chosen).settings
    for name, (text, _) in rows.items():
        value = getattr(used, name)
        expected = str(value).lower() if isinstance(value, bool) else str(value)
        assert text == ("none" if value is None else expected), name
    assert rows["threshold"] == ("0.7", "the command line")
    assert rows["temperature"] == ("0.5", "the command line")
    assert rows["max_tokens"] == ("24", "the checkpoint (generation_config.json)")
    assert rows["steps"] == ("8", "from block_length")
    assert rows["seed"] == ("0", "package default")
    assert rows["cfg_scale"][1] == "the llada family's default"
    # The settings of other samplers are listed apart, with the samplers they act with.
    assert "factor" not in rows and "  factor (acts with sampler factor)" in out
    assert set(rows) | {"factor"} <= set(used.as_dict())


def test_settings_command_refuses_bad_settings(ckpt, capsys):
    assert cli_main(["settings", "--model", str(ckpt), "--alg", "entropy"]) == 1
    assert "unknown setting(s) alg for the llada family" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["settings", "--model", str(ckpt), "--sampler", "qota"])
    assert e.value.code == 2
