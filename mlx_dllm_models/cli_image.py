"""`mlx_dllm generate --image-out OUT.png`: text-to-image (images.stream_batch) for a model that
writes images as tokens (MMaDA, Lumina-DiMOO), inpainting with `--image IN.png --mask MASK.png`
(white = repaint; MMaDA) and editing with `--image IN.png` alone (Lumina-DiMOO); `--trace OUT.html` writes a page of the image decoded after each step. `--steps`,
`--seed` and `--temp` are the settings flags generate already has; `--width`, `--height` and
`--guidance-scale` are the text-to-image group's own. A flag that means nothing for an image is
refused before the model loads."""

import io
import sys
import time
from pathlib import Path

from .cli_common import chosen_settings
from .errors import SettingsError

# The settings flags an image run reads (image keyword: setting name).
IMAGE_SETTINGS = {"steps": "steps", "seed": "seed", "temperature": "temperature"}
# Text-generation flags (argparse dest: flag) that mean nothing for an image.
TEXT_ONLY = {
    "suffix": "--suffix",
    "json_schema": "--json-schema",
    "regex": "--regex",
    "lark": "--lark",
    "system_prompt": "--system-prompt",
    "chat_template_config": "--chat-template-config",
}
# The text-to-image group's flags, which need --image-out.
IMAGE_ONLY = {"mask": "--mask", "width": "--width", "height": "--height"}
IMAGE_ONLY["guidance_scale"] = "--guidance-scale"
IMAGE_ONLY["image_guidance_scale"] = "--image-guidance-scale"
IMAGE_ONLY["edit_side"] = "--edit-side"


def add_image_flags(parser):
    """generate's "text-to-image" group."""
    g = parser.add_argument_group(
        "text-to-image",
        "models that write images as tokens (MMaDA, Lumina-DiMOO); --steps, --seed and --temp "
        "apply",
    )
    g.add_argument(
        "--image-out",
        default=None,
        metavar="OUT.png",
        help="generate an image of --prompt and write it to OUT.png (with --image and --mask: "
        "inpaint the image; with --image alone: edit it, for a model that edits)",
    )
    g.add_argument(
        "--mask",
        default=None,
        metavar="MASK.png",
        help="inpainting: the region of --image to repaint, in white",
    )
    g.add_argument("--width", type=int, default=None, help="image width in pixels")
    g.add_argument("--height", type=int, default=None, help="image height in pixels")
    g.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="classifier-free guidance (default: the model's)",
    )
    g.add_argument(
        "--image-guidance-scale",
        type=float,
        default=None,
        help="editing: the guidance against the prompt without the image (default: the model's)",
    )
    g.add_argument(
        "--edit-side",
        type=int,
        default=None,
        help="editing: the side of the largest square crop of --image (default: the model's, 512)",
    )


def refusal(args):
    """Why the flags make no sense together (None: they do), read before anything loads."""
    if args.image_out is None:
        given = [flag for dest, flag in IMAGE_ONLY.items() if getattr(args, dest) is not None]
        return f"{given[0]} needs --image-out OUT.png" if given else None
    for dest, flag in TEXT_ONLY.items():
        if getattr(args, dest) is not None:
            return f"{flag} shapes generated text; it means nothing with --image-out"
    other = sorted(set(chosen_settings(args)) - set(IMAGE_SETTINGS.values()))
    if other:
        return (
            f"--{other[0].replace('_', '-')} is a text-decoding setting; with --image-out only "
            "--steps, --seed and --temp apply"
        )
    if args.prompt is None:
        return "--image-out needs --prompt: the text of the image"
    if args.image is not None and len(args.image) > 1:
        return "--image-out inpaints one --image"
    if args.mask is not None and args.image is None:
        return "inpainting takes both --image IN.png and --mask MASK.png (white = repaint)"
    if not Path(args.image_out).resolve().parent.is_dir():
        return f"--image-out {args.image_out}: no such folder"
    return None


def open_picture(path: str, flag: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(path)
        image.load()
        return image
    except (OSError, UnidentifiedImageError) as e:
        raise SystemExit(f"error: {flag} {path}: {e}") from None


class Progress:
    """The step count, redrawn in place on a terminal."""

    def __init__(self, stream):
        self.stream = stream

    def __call__(self, step: int, steps: int):
        end = "\n" if step == steps else ""
        print(f"\rstep {step}/{steps}", end=end, file=self.stream, flush=True)


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def write_trace(path: str, prompt: str, frames):
    from .trace_page import image_steps_page

    try:
        Path(path).write_text(image_steps_page(prompt, frames), encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"error: --trace {path}: {e}") from None


def image_main(args) -> int:
    """generate with --image-out (the flags checked by `refusal` already)."""
    from .cli_common import load_for_cli
    from .images import image_spec_of, stream_batch
    from .loader import read_weights

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    overrides = chosen_settings(args)
    kwargs = {key: overrides[name] for key, name in IMAGE_SETTINGS.items() if name in overrides}
    kwargs.update(width=args.width, height=args.height, guidance_scale=args.guidance_scale)
    for key in ("image_guidance_scale", "edit_side"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    image = mask = None
    if args.image is not None:
        image = open_picture(args.image[0], "--image").convert("RGB")
        if args.mask is not None:
            mask = open_picture(args.mask, "--mask")
    model, processor = load_for_cli(args, weights=False)
    try:
        image_spec_of(model)
    except SettingsError as e:
        raise SystemExit(f"error: {e}") from None
    read_weights(model)
    progress = Progress(sys.stderr) if sys.stderr.isatty() and args.verbose else None
    started, frames = time.perf_counter(), []
    try:
        for last in stream_batch(
            model,
            processor,
            [prompt],
            images=[image],
            masks=[mask],
            # With --trace every step's image is decoded, for the page.
            every=1 if args.trace is not None else 1 << 30,
            on_step=progress,
            **kwargs,
        ):
            if args.trace is not None:
                frames.append((last[0].step, last[0].steps, png_bytes(last[0].image)))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"error: {e}") from None
    seconds = time.perf_counter() - started
    if args.trace is not None:
        write_trace(args.trace, prompt, frames)
    result = last[0]
    try:
        result.image.save(args.image_out, format="PNG")
    except OSError as e:
        raise SystemExit(f"error: --image-out {args.image_out}: {e}") from None
    if args.verbose:
        w, h = result.image.size
        print(
            f"Image: {w}x{h}, {result.steps} steps, {result.nfe} forwards, {seconds:.2f} s -> "
            f"{args.image_out}"
        )
    return 0
