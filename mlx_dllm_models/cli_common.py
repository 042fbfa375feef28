"""What `mlx_dllm generate` and `mlx_dllm chat` share: the settings flags (from the settings
table's index, settings_index, with mlx-lm's `--temp`), loading with mlx-lm's habits (`--adapter-path`, `--extra-eos-token`,
`--chat-template-config`), and the live canvas on a terminal (redrawn in place, clipped to the
terminal's height, counting display width).
"""

import argparse
import difflib
import json
import re
import shutil
import time
import unicodedata
from pathlib import Path

from .settings_index import choices, flag_rows
from .validators import CLI_KINDS, cli_bool

# mlx-lm's spelling of a setting, accepted next to ours.
ALIASES = {"temperature": ("--temp",), "max_tokens": ("-m",)}


def str2bool(text: str) -> bool:
    """mlx_lm.generate's `--verbose` values: anything but false/f (any case) is true."""
    return text.lower() not in ("false", "f")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors end with "did you mean ...?" for a misspelt flag or value:
    the commands refuse them here, before anything loads. Its usage line is short (a command has
    dozens of flags; --help lists them)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("usage", "%(prog)s [options]")
        # Abbreviations would take one flag for another (`--mode` for `--model`); an unknown flag
        # is refused with the closest one, before the model loads.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        super().error(message + suggestion(self, message))


def suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """ " (did you mean --temp?)" for argparse's "unrecognized arguments" and "invalid choice"
    messages, when a close match exists; else ""."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        flags = sorted(set(re.findall(r"--[\w-]+", parser.format_help())))
        hints = []
        for word in unknown.group(1).split():
            close = word.startswith("-") and difflib.get_close_matches(word.split("=")[0], flags)
            hints += [f"{word.split('=')[0]} -> {close[0]}"] if close else []
        return f" (did you mean: {'; '.join(hints)}?)" if hints else ""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        close = difflib.get_close_matches(choice.group(1), re.findall(r"'([^']*)'", choice[2]))
        return f" (did you mean {close[0]}?)" if close else ""
    return ""


def on_off(text: str) -> bool:
    """The value of `--x VALUE` for an on/off setting (true / false, yes / no, on / off, 1 / 0)."""
    try:
        return cli_bool(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_on_off(group, flag: str, dest: str, help: str):
    """`--x` / `--no-x` (as argparse.BooleanOptionalAction), and `--x VALUE`, the form the
    commands took first; unset (None) when neither is given."""
    group.add_argument(
        flag, dest=dest, nargs="?", const=True, type=on_off, default=None, metavar="BOOL", help=help
    )
    off = "--no-" + flag[2:]
    group.add_argument(off, dest=dest, action="store_const", const=False, help=f"{flag} false")


def fixed_values() -> dict:
    """Setting -> the values it can take at all (every sampler, every cache, the rows whose check
    is a fixed choice), from the index of the tables that define them (settings_index). Which of
    them a family takes is checked once the checkpoint is known."""
    return choices()


def one_of(setting, options):
    """The flag's parser of a setting with fixed values: an unknown one is refused with the
    values and the closest one."""

    def parse(text):
        value = CLI_KINDS[setting.kind](text)
        if value in options:
            return value
        close = difflib.get_close_matches(text, options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise argparse.ArgumentTypeError(
            f"unknown {setting.name} {text!r}; choose one of: {', '.join(options)}{hint}"
        )

    parse.__name__ = setting.name
    return parse


# The shared settings that the sampler group holds besides those scoped to samplers.
SAMPLING = ("sampler", "temperature", "top_p", "top_k")


def setting_groups():
    """(title, rows) of the settings table (its index's FlagRows) in help order: common, sampler,
    cache, then one group for each set of families a row belongs to."""
    groups = {"common settings": [], "sampler settings": [], "cache": []}
    for s in flag_rows():
        if s.families:
            title = f"{' / '.join(s.families)} settings"
        elif s.name == "cache":
            title = "cache"
        elif s.name in SAMPLING or s.samplers:
            title = "sampler settings"
        else:
            title = "common settings"
        groups.setdefault(title, []).append(s)
    return list(groups.items())


def add_setting_flags(parser: argparse.ArgumentParser):
    """One flag per row of the settings table, from its index (settings_index: no model module is
    imported), in groups (setting_groups); on/off settings take `--x` / `--no-x`, and fixed values
    are choices."""
    fixed = fixed_values()
    for title, rows in setting_groups():
        group = parser.add_argument_group(title)
        for setting in rows:
            flags = ("--" + setting.name.replace("_", "-"),) + ALIASES.get(setting.name, ())
            if setting.kind == "on/off":
                add_on_off(group, flags[0], setting.name, setting.help)
                continue
            kind = CLI_KINDS[setting.kind]
            kwargs = dict(dest=setting.name, type=kind, default=None, help=setting.help)
            options = fixed.get(setting.name)
            if options:
                kwargs.update(type=one_of(setting, options), choices=options, metavar="NAME")
                kwargs["help"] += "; one of: " + ", ".join(options)
            group.add_argument(*flags, **kwargs)


def chosen_settings(args) -> dict:
    names = [s.name for s in flag_rows()]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def add_loading_flags(parser: argparse.ArgumentParser):
    """What every command that loads a checkpoint takes: generate, chat, serve."""
    parser.add_argument(
        "--model", default=None, help="checkpoint folder (default: the embedded model)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the tokenizer run the checkpoint's code",
    )
    parser.add_argument(
        "--adapter-path",
        default=None,
        help="folder of LoRA adapters (adapter_config.json, adapters.safetensors) as mlx_lm.lora "
        "writes them, applied on the loaded model",
    )
    parser.add_argument(
        "--extra-eos-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="another token (its text or id) that ends generation (repeatable)",
    )


def add_template_config_flag(parser: argparse.ArgumentParser):
    """mlx_lm.generate's `--chat-template-config` (the server takes mlx_lm.server's
    `--chat-template-args` instead)."""
    parser.add_argument(
        "--chat-template-config",
        default=None,
        help='extra arguments of apply_chat_template, as a JSON object (e.g. \'{"enable_thinking": '
        "false}')",
    )


def add_live_and_image_flags(parser: argparse.ArgumentParser, image_help: str):
    """`--no-live` and the repeatable `--image PATH` that generate and chat take."""
    parser.add_argument(
        "--no-live", action="store_true", help="no live canvas, print blocks as they come"
    )
    parser.add_argument("--image", action="append", default=None, metavar="PATH", help=image_help)


def template_kwargs(args) -> dict:
    """The `--chat-template-config` JSON object, with a clear error for anything else."""
    if args.chat_template_config is None:
        return {}
    try:
        value = json.loads(args.chat_template_config)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --chat-template-config is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise SystemExit(
            "error: --chat-template-config must be a JSON object of apply_chat_template "
            f"arguments, not {type(value).__name__}"
        )
    return value


def load_for_cli(args, weights: bool = True):
    """(model, tokenizer or processor) for the loading flags; every failure is a one-line error.
    The weights are read with a progress bar (loader.read_weights) on a terminal; `weights=False`
    leaves them unread (lazy, for loader.read_weights later): enough for the model's spec, its
    settings and the tokenizer."""
    from .default import model_or_default
    from .distributed import launch_group, rank0_prints
    from .loader import load, read_weights
    from .vision import text_tokenizer

    model_path = model_or_default(args.model)
    kwargs = {}
    if args.adapter_path is not None:
        adapters = Path(args.adapter_path)
        missing = [
            n
            for n in ("adapter_config.json", "adapters.safetensors")
            if not (adapters / n).is_file()
        ]
        if missing:
            raise SystemExit(
                f"error: --adapter-path {adapters} holds no {' and no '.join(missing)}; give the "
                "folder that mlx_lm.lora saved the adapters in"
            )
        kwargs["adapter_path"] = str(adapters)
    # Under `mlx.launch -n N` every rank loads its shard of the model; rank 0 prints.
    group = launch_group()
    if group is None:  # a sharded load reads each rank's slice itself (loader.load)
        kwargs["lazy"] = True
    try:
        model, tokenizer = load(
            model_path,
            tokenizer_config={"trust_remote_code": args.trust_remote_code},
            group=group,
            **kwargs,
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if weights and kwargs.get("lazy"):
        read_weights(model)
    rank0_prints(group)
    text_tok = text_tokenizer(tokenizer)
    for token in args.extra_eos_token:
        try:
            text_tok.add_eos_token(token)
        except (ValueError, AttributeError) as e:
            raise SystemExit(f"error: --extra-eos-token {token!r}: {e}") from None
    return model, tokenizer


# ------------------------------------------------------------------------------ the live canvas


def char_width(ch: str) -> int:
    """Terminal columns of one character: 2 for wide and fullwidth East Asian characters and
    emoji, 0 for combining marks and format characters, else 1."""
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def display_width(text: str) -> int:
    return sum(char_width(c) for c in text)


def terminal_rows(text: str, width: int):
    """`text` cut into the rows a terminal `width` columns wide shows it in (a wide character that
    does not fit at the end of a row moves to the next one, as terminals wrap it)."""
    rows = []
    for line in text.split("\n"):
        row, used = [], 0
        for ch in line:
            w = char_width(ch)
            if used + w > width and row:
                rows.append("".join(row))
                row, used = [], 0
            row.append(ch)
            used += w
        rows.append("".join(row))
    return rows


def render(tokenizer, canvas, mask_id, eos, pending=None):
    """Text of a canvas with each mask (or each position `pending` marks, for decoders without a
    mask token) shown as a shaded cell; nothing after the first EOS."""
    out, run = [], []
    for i, t in enumerate(canvas):
        if t in eos:
            break
        if t == mask_id or (pending is not None and pending[i]):
            if run:
                out.append(tokenizer.decode(run))
                run = []
            out.append("░")
        else:
            run.append(t)
    if run:
        out.append(tokenizer.decode(run))
    return "".join(out)


class LiveView:
    """Redraws the canvas in place on a terminal.

    The cursor can only move back up over rows still on the screen: a frame taller than the
    terminal would leave its top rows in the scrollback at every redraw. So a live frame shows the
    rows that fit (the canvas's end, where it is being filled in), counted in display columns, and
    the final frame prints the whole text once."""

    def __init__(self, stream):
        self.stream = stream
        self.lines = 0
        self.last = 0.0

    def draw(self, text, force=False, final=False):
        now = time.perf_counter()
        if not (force or final) and now - self.last < 0.05:
            return
        self.last = now
        size = shutil.get_terminal_size()
        width, height = max(size.columns, 1), max(size.lines, 2)
        rows = terminal_rows(text, width)
        if not final:
            # One row stays for the cursor, which sits below the frame.
            rows = rows[-(height - 1) :]
        if self.lines:
            self.stream.write(f"\x1b[{self.lines}F")
        self.stream.write("\x1b[J" + ("\n".join(rows) if not final else text) + "\n")
        self.stream.flush()
        self.lines = len(rows)

    def draw_step(self, tokenizer, event, mask_id, eos):
        """A step event's first row, its masks (or the positions its `pending` marks) shaded."""
        pending = getattr(event, "pending", None)
        pending = pending[0].tolist() if pending is not None else None
        self.draw(render(tokenizer, event.canvas[0], mask_id, eos, pending))

    def reset(self):
        """The next frame starts below whatever is on the screen now (a new chat turn)."""
        self.lines = 0
        self.last = 0.0
