"""MkDocs hooks: the settings and CLI reference pages are generated from the code at build time,
so the documentation never holds a second copy of the settings table or of the parsers' help."""

import os
import subprocess
import sys

COMMANDS = ("generate", "chat", "serve", "settings", "convert", "lora", "fuse", "evaluate")


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def settings_table() -> str:
    from mlx_dllm_models.settings import SETTINGS

    lines = [
        "| setting | default | families | samplers | meaning |",
        "|---|---|---|---|---|",
    ]
    for row in sorted(SETTINGS, key=lambda r: r.name):
        default = "" if row.default is None else f"`{row.default!r}`"
        families = ", ".join(row.families)
        samplers = ", ".join(row.samplers)
        lines.append(
            f"| `{row.name}` | {default} | {_cell(families)} | {_cell(samplers)} | "
            f"{_cell(row.help)} |"
        )
    return "\n".join(lines)


def _help(command) -> str:
    env = dict(os.environ, COLUMNS="100")
    argv = [sys.executable, "-m", "mlx_dllm_models"] + ([command] if command else []) + ["--help"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    return (done.stdout or done.stderr).rstrip()


def cli_reference() -> str:
    parts = ["## mlx_dllm", "", "```text", _help(None), "```"]
    for command in COMMANDS:
        parts += ["", f"## mlx_dllm {command}", "", "```text", _help(command), "```"]
    return "\n".join(parts)


GENERATED = {
    "<!-- settings-table -->": settings_table,
    "<!-- cli-reference -->": cli_reference,
}


def on_page_markdown(markdown, page, config, files):
    for marker, build in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, build())
    return markdown
