"""The `mlx_dllm` command: its subcommands (COMMANDS: generate, chat, serve, convert, lora, fuse,
evaluate, settings) listed by `mlx_dllm --help` and dispatched to their modules, each of which
parses its own flags; `generate` and `convert` live here.

generate applies the tokenizer's chat template when it has one (as mlx_lm.generate does), shows the
canvas filling in live on a terminal, and ends with a statistics line; with `--image-out` it
generates an image instead (cli_image.py).
"""

import contextlib
import functools
import os
import sys

from . import __version__
from .cli_common import (
    LiveView,
    Parser,
    add_live_and_image_flags,
    add_loading_flags,
    add_setting_flags,
    add_template_config_flag,
    chosen_settings,
    load_for_cli,
    str2bool,
    template_kwargs,
)
from .cli_image import add_image_flags, image_main, refusal
from .errors import CheckpointError, SettingsError
from .prompts import has_chat_template, render_chat, user_turn


def generate_parser():
    p = Parser(
        prog="mlx_dllm generate",
        description="Generate text with a diffusion language model. Settings that name a family "
        "apply to that family only; `mlx_dllm settings` shows the values a run would use.",
    )
    add_loading_flags(p)
    add_template_config_flag(p)
    p.add_argument("--version", action="version", version=f"mlx_dllm_models {__version__}")
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument(
        "--suffix",
        default=None,
        help="infilling (LLaDA, LLaDA-MoE, Dream): text after the generated span; max_tokens "
        "masks between prompt and suffix are filled (use --ignore-chat-template for raw code)",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="structured output: the text is JSON valid under the JSON schema in FILE (or given "
        "inline, starting with '{')",
    )
    p.add_argument(
        "--regex",
        default=None,
        metavar="PATTERN",
        help="structured output: the whole text matches the regular expression PATTERN",
    )
    p.add_argument(
        "--lark",
        default=None,
        metavar="FILE",
        help="structured output: the text is in the language of the Lark grammar in FILE",
    )
    p.add_argument(
        "--ignore-chat-template", action="store_true", help="feed the prompt as raw text"
    )
    p.add_argument(
        "--verbose",
        type=str2bool,
        default=True,
        help="true (default): live canvas and statistics; false: print only the generated text",
    )
    add_live_and_image_flags(
        p,
        "an image for the prompt (repeatable; checkpoints with a vision tower); with "
        "--image-out, the image to inpaint",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="OUT.html",
        help="write a page replaying the decoding step by step to OUT.html, and the final "
        "order of commitment to OUT.svg beside it",
    )
    add_setting_flags(p)
    add_image_flags(p)
    return p


def constraint_args(args) -> dict:
    """The structured-output settings of --json-schema / --regex / --lark (files read here; a
    missing or unreadable file is an error that names it)."""
    out = {}
    for name in ("json_schema", "lark"):
        value = getattr(args, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "json_schema" and value.lstrip().startswith("{"):
            out[name] = value
            continue
        try:
            with open(value, encoding="utf-8") as f:
                out[name] = f.read()
        except OSError as e:
            raise SystemExit(f"error: {flag} {value}: {e.strerror or e}")
    if args.regex is not None:
        out["regex"] = args.regex
    return out


def generate_main(argv):
    args = generate_parser().parse_args(argv)  # first: a bad flag is refused before any loading
    problem = refusal(args)
    if problem is not None:
        raise SystemExit(f"error: {problem}")
    if args.image_out is not None:
        return image_main(args)

    from .generate import responses, stats_line, stream_events
    from .loader import read_weights
    from .vision import is_processor, text_tokenizer

    overrides = chosen_settings(args)
    overrides.update(constraint_args(args))
    chat_template_kwargs = template_kwargs(args)

    prompt = args.prompt
    if prompt is None:
        from .default import DEFAULT_PROMPT

        prompt = DEFAULT_PROMPT
        if args.verbose:
            # The answer alone ("132") does not say what was asked. On stderr: standard output
            # stays the generated text.
            print(f"No --prompt given; asking: {prompt}", file=sys.stderr)
    elif prompt == "-":
        prompt = sys.stdin.read()

    # The weights are read once the request is ready: a setting the family does not take is
    # refused before a large checkpoint's weights are read.
    model, tokenizer = load_for_cli(args, weights=False)
    text_tok = text_tokenizer(tokenizer)
    if not args.ignore_chat_template and has_chat_template(tokenizer):
        content = prompt
        if args.image and is_processor(tokenizer) and tokenizer.image_token not in prompt:
            content = tokenizer.image_token * len(args.image) + prompt
        messages = user_turn(content, args.system_prompt)
        prompt = render_chat(tokenizer, messages, chat_template_kwargs)

    try:
        s, ids, decoder = stream_events(
            model,
            tokenizer,
            [prompt],
            images=None if args.image is None else [args.image],
            suffix=args.suffix,
            **overrides,
        )
    except (ValueError, TypeError) as e:
        raise SystemExit(f"error: {e}")
    read_weights(model)

    spec = model.diffusion_spec
    live = sys.stdout.isatty() and not args.no_live and args.verbose
    view = LiveView(sys.stdout) if live else None
    on_step = None
    if view is not None:

        def on_step(event):
            view.draw_step(tokenizer, event, spec.mask_token_id, decoder.eos)

    text, last = "", None
    entries = []
    trace = None
    if args.trace is not None:
        from .trace import TraceRecorder

        trace = TraceRecorder(model, tokenizer, ids[0], s, decoder, args.trace)
    for last in responses(decoder, ids, tokenizer, on_step=on_step, trace=trace):
        text += last.text
        entries += last.logprobs or []
        if view is None:
            print(last.text, end="", flush=True)
    if view is not None:
        view.draw(text, final=True)
    else:
        print()
    if s.logprobs is not None:
        print_logprobs(text_tok, entries)
    if args.verbose:
        print("=" * 10)
        print(stats_line(last))
    if trace is not None and args.verbose:  # on stderr: standard output stays the text
        print(f"Trace: {trace.path} and {trace.path.with_suffix('.svg')}", file=sys.stderr)
    return 0


def print_logprobs(tokenizer, entries):
    """`--logprobs k`: each generated token's log-probability at the step that committed it, and
    the k best alternatives there (README, Log-probabilities), one token a line."""
    print("=" * 10)
    for entry in entries:
        top = "  ".join(f"{tokenizer.decode([t])!r} {lp:.4f}" for t, lp in entry.top)
        print(f"{tokenizer.decode([entry.token])!r}\t{entry.logprob:.4f}\t{top}")


def serve_main(argv):
    """`mlx_dllm serve`: its flags are checked first (server.flags, light), then the server loads
    (imported on use, as generate_main imports the engine)."""
    from .server.flags import check_args, parser

    check_args(parser().parse_args(argv))
    from .server import main as serve

    # Under mlx.launch, rank 0 serves and hands each request to the others (server.Scheduler).
    return serve(argv)


def convert_main(argv):
    """Delegate to mlx_lm's convert, with this package's model types registered."""
    import importlib

    import mlx_dllm_models_hook  # noqa: F401

    # `mlx_lm.convert` the attribute is the function; the module holds the CLI's parser.
    convert = importlib.import_module("mlx_lm.convert")
    parser = convert.configure_parser()
    parser.prog = "mlx_dllm convert"
    parser.add_argument(
        "--model-type",
        default=None,
        help="write this model_type into the converted config: open_dcoder for an Open-dCoder "
        "checkpoint, which is saved as a plain qwen2 (with its tokenizer's mask id)",
    )
    args = parser.parse_args(argv)
    if args.hf_path is None:  # mlx-lm's parser does not require it, and fails late without it
        parser.error("--hf-path is required: a local checkpoint folder or a Hugging Face repo id")
    why = _quantization_problem(args)
    if why:
        raise SystemExit(f"error: {why}")
    from .conversion import atomic_output, check_source, finish_conversion, retyped_config
    from .loader import resolve_checkpoint

    # The source first: a local folder (mlx-lm took any other path for a malformed repo id), or a
    # repo id fetched into the Hugging Face cache; its weight files all there and whole.
    source = resolve_checkpoint(args.hf_path, getattr(args, "revision", None))
    if not source.exists():
        raise CheckpointError(
            f"no checkpoint at {args.hf_path}: give a local folder holding config.json and the "
            "weights, or a Hugging Face repo id ('org/name')"
        )
    check_source(source)
    kwargs = vars(args)
    model_type = kwargs.pop("model_type")
    # mlx-lm's load reads the source's config.json with these entries over it, so that it builds
    # (and saves the config of) that model_type.
    overrides = retyped_config(source, model_type) if model_type else None
    load = functools.partial(convert.load, model_config=overrides) if overrides else convert.load
    # Written beside --mlx-path and renamed into place once complete; an existing --mlx-path is
    # refused before any work.
    with atomic_output(args.mlx_path, "--mlx-path") as out, _patched(convert, "load", load):
        try:
            convert.convert(**{**kwargs, "mlx_path": str(out)})
        except ValueError as e:  # mlx-lm's and the loader's messages about the input
            raise SystemExit(f"error: {e}") from None
        # No remote code (auto_map, *.py) in the output, and a model card naming our commands.
        finish_conversion(out, args.hf_path)
    return 0


@contextlib.contextmanager
def _patched(module, name, value):
    """`module.<name>` is `value` inside the block (mlx-lm's convert takes no model_config)."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# What mlx.core.quantize accepts in its "affine" mode (mlx-lm's default --q-mode); other modes fix
# their own bits and group size.
AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


def _quantization_problem(args):
    """Why --q-bits / --q-group-size cannot be honoured, or None: checked before any work, since
    mlx-lm replaces 0 by its default and writes a config that claims quantization when a group
    size does not divide the weights."""
    given = [f for f in ("q_bits", "q_group_size") if getattr(args, f) is not None]
    if given and not args.quantize:
        flags = " / ".join("--" + f.replace("_", "-") for f in given)
        return f"{flags} only act with -q (--quantize); add -q or drop them"
    if args.q_mode != "affine":
        return None
    if args.q_bits is not None and args.q_bits not in AFFINE_BITS:
        choices = ", ".join(map(str, AFFINE_BITS))
        return f"--q-bits {args.q_bits} is not supported by mlx; choose one of {choices}"
    if args.q_group_size is not None and args.q_group_size not in AFFINE_GROUP_SIZES:
        choices = ", ".join(map(str, AFFINE_GROUP_SIZES))
        return (
            f"--q-group-size {args.q_group_size} is not supported by mlx; choose one of {choices}"
        )
    return None


def evaluate_main(argv):
    """lm-evaluation-harness on a diffusion model (mlx_dllm_models.evaluate); lm-eval is the
    optional `[eval]` extra, so the module is imported only here, after the flags (and --help)
    are read without it."""
    from .evaluate_args import INSTALL, build_parser

    build_parser().parse_args(argv)
    try:
        from . import evaluate
    except ImportError as e:
        if getattr(e, "name", "") != "lm_eval":
            raise
        raise SystemExit(f"error: mlx_dllm evaluate {INSTALL}") from None
    try:
        evaluate.main(argv)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    return 0


def chat_main(argv):
    from .chat import chat_main

    return chat_main(argv)


def lora_main(argv):
    from .lora import lora_main

    return lora_main(argv)


def fuse_main(argv):
    from .lora import fuse_main

    return fuse_main(argv)


def settings_main(argv):
    from .cli_settings import settings_main

    return settings_main(argv)


# name -> (one line of `mlx_dllm --help`, the command); each command parses its own flags, and
# imports what it needs only when run, so that this list prints at once.
COMMANDS = {
    "generate": ("generate text from a prompt, the canvas filling in live", generate_main),
    "chat": ("chat in the terminal (as mlx_lm.chat)", chat_main),
    "serve": ("an OpenAI-compatible HTTP server (as mlx_lm.server)", serve_main),
    "convert": ("a Hugging Face checkpoint to MLX, optionally quantized", convert_main),
    "lora": ("fine-tune LoRA adapters, masked-diffusion loss (as mlx_lm.lora)", lora_main),
    "fuse": ("fold LoRA adapters into the weights (as mlx_lm.fuse)", fuse_main),
    "evaluate": ("lm-evaluation-harness tasks (the [eval] extra)", evaluate_main),
    "settings": ("each setting a run would use, its value and origin", settings_main),
}


def top_parser():
    p = Parser(
        prog="mlx_dllm",
        description="Diffusion language models on MLX. `mlx_dllm COMMAND --help` for a "
        "command's options.",
        usage="%(prog)s COMMAND [options]",
    )
    p.add_argument("--version", action="version", version=f"mlx_dllm_models {__version__}")
    commands = p.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, (line, _) in COMMANDS.items():
        # The command's own parser reads its flags (and --help): this one only picks it.
        commands.add_parser(name, help=line, add_help=False)
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = top_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    try:
        args, rest = parser.parse_known_args(argv)
        if args.command is None:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:  # --help, --version, an unknown command (argparse printed why)
        return e.code
    from .distributed import lost_rank_exits

    try:
        # Launched over several ranks (mlx.launch): a rank that dies ends the others with an error.
        with lost_rank_exits():
            return COMMANDS[args.command][1](rest)
    except (SettingsError, CheckpointError) as e:  # raised mid-run (corrupt weights, a schedule)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`mlx_dllm generate ... | head`): it has what it wanted. Point
        # stdout at /dev/null so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("error: the output was closed before generation ended (broken pipe)", file=sys.stderr)
        return 141  # 128 + SIGPIPE, as a shell reports a process killed by it
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
