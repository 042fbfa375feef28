"""The CLI's index of the settings table: what the commands' parsers need of every row (name,
help, the kind of its flag, its fixed values, the families and samplers it belongs to), and the
values `--sampler` and `--cache` take, kept in settings_index.json beside this file.

settings.SETTINGS is collected from every family's model file, which imports mlx-lm (and
transformers): seconds before a parser could refuse a misspelt flag. The index is read instead,
with the standard library alone; the real table still validates every value once the checkpoint
is known. The index is generated from the real table, and a test fails when it is stale:

    python -m mlx_dllm_models.settings_index --write
"""

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

INDEX_PATH = Path(__file__).with_name("settings_index.json")
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


def stale() -> bool:
    return not INDEX_PATH.is_file() or INDEX_PATH.read_text(encoding="utf-8") != render(build())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mlx_dllm_models.settings_index",
        description="Check (default) or rewrite the CLI's index of the settings table.",
    )
    p.add_argument("--write", action="store_true", help=f"rewrite {INDEX_PATH.name}")
    args = p.parse_args(argv)
    if args.write:
        INDEX_PATH.write_text(render(build()), encoding="utf-8")
        print(f"wrote {INDEX_PATH}")
        return 0
    if stale():
        print(f"{INDEX_PATH} is stale: run {WRITE_COMMAND}", file=sys.stderr)
        return 1
    print(f"{INDEX_PATH} matches the settings table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
