"""What the text-to-image tests share: a decoder run on given uniforms, and the CLI's PNG."""

import mlx.core as mx
from PIL import Image

from helpers import run_cli


def run_on_draws(decoder, draws, **settings):
    """Every event of `decoder.run(**settings)` taking step s's uniforms from the numpy arrays
    `draws(s)`, as the reference takes them."""
    return list(decoder.run(draws=lambda s: tuple(mx.array(a) for a in draws(s)), **settings))


def cli_writes_a_png(ckpt, out, *flags):
    """`mlx_dllm generate --image-out out` of "a red cat" at 24x16 in 2 steps (seed 3) and
    `flags`: the PNG has that size and the summary says it; the finished process."""
    size = ["--width", "24", "--height", "16", "--steps", "2", "--seed", "3"]
    done = run_cli(
        "generate",
        "--model",
        str(ckpt),
        "--prompt",
        "a red cat",
        "--image-out",
        str(out),
        *size,
        *flags,
    )
    assert done.returncode == 0, done.stderr
    assert Image.open(out).size == (24, 16)
    assert "24x16" in done.stdout and "2 steps" in done.stdout
    return done
