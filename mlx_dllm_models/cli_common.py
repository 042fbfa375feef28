"""What `mlx_dllm generate` and `mlx_dllm chat` share: the settings flags (from settings.SETTINGS,
with mlx-lm's `--temp`), loading with mlx-lm's habits (`--adapter-path`, `--extra-eos-token`,
`--chat-template-config`), and the live canvas on a terminal (redrawn in place, clipped to the
terminal's height, counting display width).
"""

import argparse
import json
import shutil
import time
import unicodedata
from pathlib import Path

from .settings import SETTINGS

# mlx-lm's spelling of a setting, accepted next to ours.
ALIASES = {"temperature": ("--temp",), "max_tokens": ("-m",)}


def str2bool(text: str) -> bool:
    """mlx_lm.generate's `--verbose` values: anything but false/f (any case) is true."""
    return text.lower() not in ("false", "f")


def add_setting_flags(parser: argparse.ArgumentParser):
    """One flag per row of settings.SETTINGS (its help says which family it belongs to)."""
    for setting in SETTINGS:
        flags = ("--" + setting.name.replace("_", "-"),) + ALIASES.get(setting.name, ())
        parser.add_argument(
            *flags, dest=setting.name, type=setting.cli_type, default=None, help=setting.help
        )


def chosen_settings(args) -> dict:
    return {s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name) is not None}


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


def load_for_cli(args):
    """(model, tokenizer or processor) for the loading flags; every failure is a one-line error."""
    from .default import model_or_default
    from .distributed import launch_group, rank0_prints
    from .loader import load
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
    try:
        model, tokenizer = load(
            model_path,
            tokenizer_config={"trust_remote_code": args.trust_remote_code},
            group=group,
            **kwargs,
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
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

    def reset(self):
        """The next frame starts below whatever is on the screen now (a new chat turn)."""
        self.lines = 0
        self.last = 0.0
