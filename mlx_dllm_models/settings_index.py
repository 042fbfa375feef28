"""The CLI's index of the settings table: what the commands' parsers need of every row (name,
help, the kind of its flag, its fixed values, the families and samplers it belongs to), and the
values `--sampler` and `--cache` take, kept in settings_index.json beside this file; and the
source of settings_fields.py, the resolved settings' frozen dataclass (a field per row, typed by its
flag's kind), so that a type checker sees every setting's name.

settings.SETTINGS is collected from every family's model file, which imports mlx-lm (and
transformers): seconds before a parser could refuse a misspelt flag. The index is read instead,
with the standard library alone; the real table still validates every value once the checkpoint
is known. Both files are generated from the real table, and a test fails when either is stale:

    python -m mlx_dllm_models.settings_index --write
"""

import argparse
import functools
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

INDEX_PATH = Path(__file__).with_name("settings_index.json")
FIELDS_PATH = Path(__file__).with_name("settings_fields.py")
WRITE_COMMAND = "python -m mlx_dllm_models.settings_index --write"


@dataclass(frozen=True)
class FlagRow:
    """A row of the settings table as the CLI sees it."""

    name: str
    help: str
    kind: str  # a key of validators.CLI_KINDS
    families: Tuple[str, ...] = ()
    samplers: Tuple[str, ...] = ()


def build() -> dict:
    """The index of the real table (importing every family's model module and the engine's
    tables): rows in table order, and setting -> the values it can take at all (every sampler:
    decoding.samplers' shared commit rules, the samplers the model files declare and those the
    engine's decoding loops implement themselves; every
    cache: engine.registry's backends; the rows whose check is a fixed choice). Which of them a
    family takes is checked once the checkpoint is known."""
    from .decoding.samplers import COMMIT_RULES
    from .engine.registry import BACKENDS, DECODERS
    from .settings import FAMILY_SAMPLERS, SETTINGS
    from .validators import CLI_KINDS

    kinds = {parse: kind for kind, parse in CLI_KINDS.items()}
    rows = []
    for s in SETTINGS:
        if s.cli_type not in kinds:
            raise ValueError(
                f"setting {s.name}: its cli_type {s.cli_type!r} is not one of "
                "validators.CLI_KINDS; add it there"
            )
        rows.append(
            dict(
                name=s.name,
                help=s.help,
                kind=kinds[s.cli_type],
                families=list(s.families),
                samplers=list(s.samplers),
            )
        )
    loops = [n for decoder in DECODERS.values() for n in decoder.samplers]
    choices = {
        "sampler": list(dict.fromkeys([*COMMIT_RULES, *FAMILY_SAMPLERS, *loops])),
        "cache": ["auto"] + sorted({name for row in BACKENDS.values() for name in row}),
    }
    for s in SETTINGS:
        options = getattr(s.check, "options", None)
        if options:
            choices[s.name] = list(options)
    return {"settings": rows, "choices": choices}


def render(index: dict) -> str:
    """The file's text: one stable spelling, so that a stale index shows as a text difference."""
    return json.dumps(index, indent=1, ensure_ascii=False) + "\n"


@functools.lru_cache(maxsize=None)
def read() -> dict:
    return json.loads(INDEX_PATH.read_text(encoding="utf-8"))


def flag_rows() -> Tuple[FlagRow, ...]:
    """The table's rows, in its order."""
    return tuple(
        FlagRow(r["name"], r["help"], r["kind"], tuple(r["families"]), tuple(r["samplers"]))
        for r in read()["settings"]
    )


def choices() -> Dict[str, Tuple[str, ...]]:
    """Setting -> the values it can take at all (build)."""
    return {name: tuple(values) for name, values in read()["choices"].items()}


# A flag's kind (validators.CLI_KINDS) -> the type of the setting's value.
VALUE_TYPES = {
    "int": "int",
    "float": "float",
    "str": "str",
    "on/off": "bool",
    "optional float": "float",
}

FIELDS_HEADER = f'''"""The resolved settings: a frozen dataclass with a field per row of the settings table, in its
order, typed by the row's flag (settings_record.SettingsRecord: which of them a family has, and
as_dict). Generated from settings.SETTINGS; do not edit, rewrite it with
{WRITE_COMMAND}
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from .settings_record import SettingsRecord


@dataclass(frozen=True)
class ResolvedSettings(SettingsRecord):
'''


def render_fields() -> str:
    """settings_fields.py's text: a field per row, its default the package default (None for a
    family's row), Optional where that default is None."""
    from .settings import SETTINGS
    from .settings_record import RECORD_NAMES

    lines = [FIELDS_HEADER]
    for s, row in zip(SETTINGS, build()["settings"]):
        if s.name in RECORD_NAMES:
            raise ValueError(f"setting {s.name}: the name is one of the resolved settings' methods")
        kind = VALUE_TYPES[row["kind"]]
        kind = kind if s.default is not None else f"Optional[{kind}]"
        default = json.dumps(s.default) if isinstance(s.default, str) else repr(s.default)
        if '"' in s.help or "\\" in s.help:
            raise ValueError(f"setting {s.name}: its help is written into a docstring: no quotes")
        doc = textwrap.fill(s.help, 93, initial_indent='    """', subsequent_indent="    ")
        lines.append(f'    {s.name}: {kind} = {default}\n{doc}"""\n')
    lines.append("    present: Tuple[str, ...] = ()\n")
    lines.append('    """The settings the family has, in resolution order (SettingsRecord)."""\n')
    return "".join(lines)


def _differs(path: Path, text: str) -> bool:
    return not path.is_file() or path.read_text(encoding="utf-8") != text


def stale() -> bool:
    return _differs(INDEX_PATH, render(build())) or _differs(FIELDS_PATH, render_fields())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mlx_dllm_models.settings_index",
        description="Check (default) or rewrite the CLI's index of the settings table.",
    )
    p.add_argument(
        "--write", action="store_true", help=f"rewrite {INDEX_PATH.name} and {FIELDS_PATH.name}"
    )
    args = p.parse_args(argv)
    if args.write:
        INDEX_PATH.write_text(render(build()), encoding="utf-8")
        FIELDS_PATH.write_text(render_fields(), encoding="utf-8")
        print(f"wrote {INDEX_PATH} and {FIELDS_PATH}")
        return 0
    if stale():
        print(f"{INDEX_PATH} or {FIELDS_PATH} is stale: run {WRITE_COMMAND}", file=sys.stderr)
        return 1
    print(f"{INDEX_PATH} and {FIELDS_PATH} match the settings table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
