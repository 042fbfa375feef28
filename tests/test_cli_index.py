"""The CLI's index of the settings table (settings_index.json): generated from the real table, a
stale index is caught (naming the command that rewrites it), and the commands build their flags
from it, so a misspelt flag or value is refused without importing a model module, mlx-lm or
transformers."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import cli_env
from mlx_dllm_models import settings, settings_index
from mlx_dllm_models.cli_common import setting_groups
from mlx_dllm_models.settings import SETTINGS
from mlx_dllm_models.validators import CLI_KINDS

ROOT = Path(__file__).resolve().parents[1]


def test_the_index_is_the_settings_table():
    shipped = settings_index.INDEX_PATH.read_text(encoding="utf-8")
    assert shipped == settings_index.render(settings_index.build()), (
        f"{settings_index.INDEX_PATH.name} is stale: run {settings_index.WRITE_COMMAND}"
    )


def test_each_row_keeps_its_flag_parser_and_scope():
    rows = settings_index.flag_rows()
    assert [r.name for r in rows] == [s.name for s in SETTINGS]
    for row, s in zip(rows, SETTINGS):
        assert CLI_KINDS[row.kind] is s.cli_type, s.name
        assert (row.help, row.families, row.samplers) == (s.help, s.families, s.samplers)
    grouped = [r.name for _, group in setting_groups() for r in group]
    assert sorted(grouped) == sorted(s.name for s in SETTINGS)
    assert settings_index.choices()["mode"] == ("diffusion", "self_spec")


def test_a_flag_parser_outside_the_kinds_is_refused(monkeypatch):
    odd = replace(settings.BY_NAME["seed"], name="odd", cli_type=complex)
    monkeypatch.setattr(settings, "SETTINGS", (*SETTINGS, odd))
    with pytest.raises(ValueError, match="setting odd: .* validators.CLI_KINDS"):
        settings_index.build()


def test_the_check_names_the_command_and_write_mends_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "settings_index.json"
    monkeypatch.setattr(settings_index, "INDEX_PATH", path)
    monkeypatch.setattr(settings_index, "FIELDS_PATH", tmp_path / "settings_fields.py")
    assert settings_index.main([]) == 1  # no file
    path.write_text(settings_index.render({"settings": [], "choices": {}}), encoding="utf-8")
    assert settings_index.main([]) == 1
    assert settings_index.WRITE_COMMAND in capsys.readouterr().err
    assert settings_index.main(["--write"]) == 0
    assert settings_index.main([]) == 0
    assert path.read_text(encoding="utf-8") == settings_index.INDEX_PATH.read_text()


# A command's refusal in a fresh interpreter: its exit code, then the heavy modules it loaded (the
# settings table, a model module, mlx-lm, transformers, torch, numpy).
REFUSE = """
import sys
from mlx_dllm_models.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
packages = ("mlx_lm", "transformers", "torch", "numpy")
heavy = [
    m for m, module in sys.modules.items()
    if module is not None and (m.split(".")[0] in packages or m == "mlx_dllm_models.settings"
    or m.startswith("mlx_dllm_models.models"))
]
print(code, sorted(heavy))
"""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tmep", "0.5"], "did you mean: --tmep -> --temp?"),
        (["--sampler", "qota"], "unknown sampler 'qota'"),
        (["--editing-mode", "qualty"], "did you mean quality?"),
        (["--early-stop", "maybe"], "expected true or false"),
    ],
)
def test_a_refused_flag_imports_no_model_mlx_lm_or_transformers(argv, message, tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", REFUSE, "generate", "--model", str(tmp_path / "none"), *argv],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert message in out.stderr and "no checkpoint" not in out.stderr, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "2 []", out.stdout
