"""`mlx_dllm generate` and `mlx_dllm convert`.

generate applies the tokenizer's chat template when it has one (as mlx_lm.generate does), shows the
canvas filling in live on a terminal, and ends with a statistics line.
"""

import argparse
import json
import shutil
import sys
import time

from .settings import SETTINGS


def _parse_value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _generate_parser():
    p = argparse.ArgumentParser(
        prog="mlx_dllm generate",
        description="Generate text with a diffusion language model. Settings that name a family "
        "apply to that family only.",
        # Abbreviations would take one flag for another (`--mode` for `--model`), and an unknown
        # flag passes through to the settings layer, whose error lists what the family knows.
        allow_abbrev=False,
    )
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument(
        "--ignore-chat-template", action="store_true", help="feed the prompt as raw text"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the tokenizer run the checkpoint's code",
    )
    p.add_argument(
        "--no-live", action="store_true", help="no live canvas, print blocks as they come"
    )
    p.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH",
        help="an image for the prompt (repeatable; checkpoints with a vision tower)",
    )
    for setting in SETTINGS:
        flag = "--" + setting.name.replace("_", "-")
        p.add_argument(
            flag, dest=setting.name, type=setting.cli_type, default=None, help=setting.help
        )
    return p


def _extra_settings(unknown):
    """Turn leftover `--some-name VALUE` pairs into settings: the settings layer rejects them with
    the names the family understands, so nothing passed here is silently ignored."""
    extra, i = {}, 0
    while i < len(unknown):
        tok = unknown[i]
        if not tok.startswith("--"):
            raise SystemExit(f"error: unexpected argument {tok!r}")
        name = tok[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(unknown):
                raise SystemExit(f"error: {tok} needs a value")
            value = unknown[i + 1]
            i += 2
        extra[name.replace("-", "_")] = _parse_value(value)
    return extra


def _render(tokenizer, canvas, mask_id, eos, pending=None):
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


class _LiveView:
    """Redraws the canvas in place on a terminal."""

    def __init__(self, stream):
        self.stream = stream
        self.lines = 0
        self.last = 0.0

    def draw(self, text, force=False):
        now = time.perf_counter()
        if not force and now - self.last < 0.05:
            return
        self.last = now
        width = max(shutil.get_terminal_size().columns, 20)
        if self.lines:
            self.stream.write(f"\x1b[{self.lines}F")
        self.stream.write("\x1b[J" + text + "\n")
        self.stream.flush()
        self.lines = sum(max(1, -(-len(line) // width)) for line in text.split("\n"))


def generate_main(argv):
    from .generate import responses, stats_line, stream_events
    from .loader import load
    from .vision import is_processor, text_tokenizer

    parser = _generate_parser()
    args, unknown = parser.parse_known_args(argv)
    settings = {
        s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name) is not None
    }
    settings.update(_extra_settings(unknown))

    model_path = args.model
    if model_path is None:
        from .default import default_checkpoint

        model_path = default_checkpoint()
    prompt = args.prompt
    if prompt is None:
        from .default import DEFAULT_PROMPT

        prompt = DEFAULT_PROMPT
    elif prompt == "-":
        prompt = sys.stdin.read()

    try:
        model, tokenizer = load(
            model_path, tokenizer_config={"trust_remote_code": args.trust_remote_code}
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    text_tok = text_tokenizer(tokenizer)
    if not args.ignore_chat_template and getattr(text_tok, "chat_template", None):
        content = prompt
        if args.image and is_processor(tokenizer) and tokenizer.image_token not in prompt:
            content = tokenizer.image_token * len(args.image) + prompt
        messages = []
        if args.system_prompt:
            messages.append({"role": "system", "content": args.system_prompt})
        messages.append({"role": "user", "content": content})
        prompt = text_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    try:
        s, ids, decoder = stream_events(model, tokenizer, [prompt], images=args.image, **settings)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"error: {e}")

    spec = model.diffusion_spec
    view = _LiveView(sys.stdout) if sys.stdout.isatty() and not args.no_live else None
    on_step = None
    if view is not None:

        def on_step(event):
            pending = getattr(event, "pending", None)
            pending = pending[0].tolist() if pending is not None else None
            view.draw(_render(tokenizer, event.canvas[0], spec.mask_token_id, decoder.eos, pending))

    text, last = "", None
    for last in responses(decoder, ids, tokenizer, on_step=on_step):
        text += last.text
        if view is None:
            print(last.text, end="", flush=True)
    if view is not None:
        view.draw(text, force=True)
    else:
        print()
    stats = last
    print("=" * 10)
    print(stats_line(stats))
    return 0


def convert_main(argv):
    """Delegate to mlx_lm's convert, with this package's model types registered."""
    import importlib

    import mlx_dllm_models_hook  # noqa: F401

    # `mlx_lm.convert` the attribute is the function; the module holds the CLI's main().
    convert = importlib.import_module("mlx_lm.convert")
    sys.argv = ["mlx_lm.convert"] + list(argv)
    convert.main()
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"generate": generate_main, "convert": convert_main}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: mlx_dllm {generate,convert} [options]   (mlx_dllm COMMAND --help for details)"
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
