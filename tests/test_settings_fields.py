"""The resolved settings' frozen dataclass (settings_fields.py): generated from the settings
table, a stale module is caught naming the command that rewrites it, and the object answers what
a family has and serialises the present settings only."""

import dataclasses

import pytest

from mlx_dllm_models import settings_index
from mlx_dllm_models.settings import SETTINGS
from mlx_dllm_models.settings_fields import ResolvedSettings
from mlx_dllm_models.settings_record import RECORD_NAMES


def test_the_fields_module_is_the_settings_table():
    shipped = settings_index.FIELDS_PATH.read_text(encoding="utf-8")
    assert shipped == settings_index.render_fields(), (
        f"{settings_index.FIELDS_PATH.name} is stale: run {settings_index.WRITE_COMMAND}"
    )


def test_a_field_per_row_in_table_order():
    names = [f.name for f in dataclasses.fields(ResolvedSettings)]
    assert names == [s.name for s in SETTINGS] + ["present"]
    assert not set(names) & (set(RECORD_NAMES) - {"present"})


def test_a_stale_fields_module_fails_the_check(tmp_path, monkeypatch, capsys):
    path = tmp_path / "settings_fields.py"
    monkeypatch.setattr(settings_index, "FIELDS_PATH", path)
    path.write_text(settings_index.render_fields().replace("    seed: int = 0\n", ""))
    assert settings_index.stale()
    assert settings_index.main([]) == 1
    assert settings_index.WRITE_COMMAND in capsys.readouterr().err


def test_present_settings_and_the_one_serialisation():
    s = ResolvedSettings.from_dict({"max_tokens": 8, "seed": 3})
    assert (s.max_tokens, s.seed, s.has("seed"), s.has("alg"), s.alg) == (8, 3, True, False, None)
    assert s.as_dict() == {"max_tokens": 8, "seed": 3}
    assert dataclasses.replace(s, seed=4).as_dict() == {"max_tokens": 8, "seed": 4}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 5
    with pytest.raises(TypeError):
        s["seed"]
    with pytest.raises(TypeError, match="sead"):
        ResolvedSettings.from_dict({"sead": 1})


def test_a_setting_named_as_a_method_is_refused(monkeypatch):
    from mlx_dllm_models import settings

    odd = dataclasses.replace(settings.BY_NAME["seed"], name="as_dict")
    monkeypatch.setattr(settings, "SETTINGS", (*SETTINGS, odd))
    with pytest.raises(ValueError, match="setting as_dict: .* methods"):
        settings_index.render_fields()
