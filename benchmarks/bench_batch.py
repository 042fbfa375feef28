"""A batch against the same prompts one by one, for every family (issue #14 section 4).

    python benchmarks/bench_batch.py [--prompt 64] [--max-tokens 64] [--runs 3] [--families ...]

Random float32 checkpoints written by the test fixtures' builders at a larger size (LLaDA2 and
Nemotron: benchmarks/bench_vs_mlx_vlm.py's hidden 512 / 6 layers; the others hidden 256 / 4
layers), loaded through the package's loader. For each family and sampler, N distinct prompts
(random byte tokens) decode at temperature 0 one after another and then as one batch
(`batch_generate_diffusion`), for N = 4 and 8. The table gives the forwards of each, the
generated tokens per second, and the speed of the batch relative to one by one (above 1: the batch
is faster). Medians of --runs runs after a warm-up, the two ways alternating run by run. The
machine may be shared: compare the two columns of one row.

    python benchmarks/bench_batch.py --varied 64 --longest 400 [--model PATH] [--max-tokens 16]

Prompts of very different lengths (issue #27 section 4): N prompts of 1 to --longest tokens
(uniform, seeded), at temperature 0, one by one, as one run padded to the longest prompt (what
batch_generate_diffusion did before), and through batch_generate_diffusion (runs of similar
length); seconds of each (medians of --runs runs), forwards, and the batch's speed relative to one
by one. --model: a checkpoint (default: the embedded default model).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import mlx.core as mx  # noqa: E402
from bench_vs_mlx_vlm import build_llada2, build_nemotron  # noqa: E402

from mlx_dllm_models import batch_generate_diffusion, load  # noqa: E402

MID = dict(HIDDEN=256, LAYERS=4)


def _scaled(module, builder, **sizes):
    def build(path):
        saved = {k: getattr(module, k) for k in sizes}
        for k, v in sizes.items():
            setattr(module, k, v)
        try:
            return builder(path)
        finally:
            for k, v in saved.items():
                setattr(module, k, v)

    return build


def builders():
    from fixtures import diffusion_gemma, dream, llada, sdar

    gemma_text = dict(
        diffusion_gemma.TEXT_CONFIG, hidden_size=256, intermediate_size=768, num_hidden_layers=4
    )
    gemma_text["layer_types"] = (diffusion_gemma.LAYER_TYPES * 2)[:4]
    return {
        "llada": _scaled(llada, llada.build_llada, **MID),
        "dream": _scaled(dream, dream.build, INTERMEDIATE=768, **MID),
        "sdar": _scaled(sdar, sdar.build_sdar, HEAD_DIM=64, BLOCK_SIZE=8, **MID),
        "sdar_moe": _scaled(sdar, sdar.build_sdar_moe, HEAD_DIM=64, BLOCK_SIZE=8, **MID),
        "llada2": lambda p: build_llada2(p),
        "nemotron": lambda p: build_nemotron(p),
        "diffusion_gemma": _scaled(diffusion_gemma, diffusion_gemma.build, TEXT_CONFIG=gemma_text),
    }


SAMPLERS = {
    "default": {},
    "threshold 0.9": {"sampler": "threshold", "threshold": 0.9},
}


def timed(fn):
    tic = time.perf_counter()
    nfe = fn()
    return time.perf_counter() - tic, nfe


def varied(args):
    """The --varied table: one by one, one padded run, batch_generate_diffusion."""
    from mlx_dllm_models.default import model_or_default
    from mlx_dllm_models.generate import stream_events

    model, tok = load(model_or_default(args.model))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, args.longest + 1, size=args.varied)
    prompts = [[int(t) for t in rng.integers(10, 250, size=n)] for n in lengths]
    kw = dict(max_tokens=args.max_tokens, temperature=0)

    def singles():
        return sum(batch_generate_diffusion(model, tok, [p], **kw).nfe for p in prompts)

    def padded():
        s, ids, decoder = stream_events(model, tok, prompts, **kw)
        for _ in decoder.run(ids):
            pass
        return decoder.nfe

    def batch():
        return batch_generate_diffusion(model, tok, prompts, **kw).nfe

    ways = {"one by one": singles, "one padded run": padded, "batch_generate_diffusion": batch}
    wall = {name: [] for name in ways}
    cpu = {name: [] for name in ways}
    forwards = {}
    for _ in range(args.runs):  # the ways alternate run by run
        for name, fn in ways.items():
            tic = time.process_time()
            t, forwards[name] = timed(fn)
            cpu[name].append(time.process_time() - tic)
            wall[name].append(t)
    w = {name: statistics.median(v) for name, v in wall.items()}
    c = {name: statistics.median(v) for name, v in cpu.items()}
    # Process CPU time as well: on a shared machine the wall clock also measures the neighbours.
    print(f"mlx {mx.__version__}, {mx.default_device()}; medians of {args.runs} runs")
    print(
        "| prompts | max_tokens | one by one: s, CPU s (forwards) | one padded run "
        "| batch_generate_diffusion | batch vs one by one (wall, CPU) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    cells = " | ".join(f"{w[n]:.1f}, {c[n]:.1f} ({forwards[n]})" for n in ways)
    batch_name = "batch_generate_diffusion"
    print(
        f"| {args.varied} of 1-{args.longest} tokens | {args.max_tokens} | {cells} "
        f"| {w['one by one'] / w[batch_name]:.2f}x, {c['one by one'] / c[batch_name]:.2f}x |",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--families", nargs="+")
    ap.add_argument(
        "--no-row-steps",
        action="store_true",
        help="run every step's forward over the whole batch (the engine before issue #14 §4), "
        "for an A/B of the row subsets",
    )
    ap.add_argument("--varied", type=int, help="prompts of very different lengths (see above)")
    ap.add_argument("--longest", type=int, default=400)
    ap.add_argument("--model", help="--varied: a checkpoint (default: the embedded default)")
    args = ap.parse_args()
    if args.varied:
        return varied(args)
    if args.no_row_steps:
        from mlx_dllm_models.engine import FullRecompute
        from mlx_dllm_models.engine.block_cache import PrefixCache
        from mlx_dllm_models.engine.causal_prefix import CausalPrefixCache

        for backend in (FullRecompute, PrefixCache, CausalPrefixCache):
            backend.row_steps = False
    rng = np.random.default_rng(0)
    print(f"mlx {mx.__version__}, {mx.default_device()}; medians of {args.runs} runs")
    print(
        "| family | sampler | N | forwards one by one | forwards batched | tok/s one by one "
        "| tok/s batched | batch vs one by one |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for family, build in builders().items():
        if args.families and family not in args.families:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp) / family)
            model, tok = load(str(Path(tmp) / family))
        samplers = {"default": {}} if family == "diffusion_gemma" else SAMPLERS
        for label, extra in samplers.items():
            kw = dict(max_tokens=args.max_tokens, **extra)
            if family != "diffusion_gemma":  # its temperature follows t_max..t_min
                kw["temperature"] = 0
            for n in args.sizes:
                prompts = [
                    [int(t) for t in rng.integers(10, 250, size=args.prompt)] for _ in range(n)
                ]
                tokens = [0]

                def singles():
                    nfe = 0
                    tokens[0] = 0
                    for p in prompts:
                        out = batch_generate_diffusion(model, tok, [p], **kw)
                        nfe += out.nfe
                        tokens[0] += len(out.tokens[0])
                    return nfe

                def batch():
                    return batch_generate_diffusion(model, tok, prompts, **kw).nfe

                singles(), batch()  # warm-up
                one, many = [], []
                for _ in range(args.runs):
                    one.append(timed(singles))
                    many.append(timed(batch))
                t1 = statistics.median(t for t, _ in one)
                tb = statistics.median(t for t, _ in many)
                print(
                    f"| {family} | {label} | {n} | {one[0][1]} | {many[0][1]} "
                    f"| {tokens[0] / t1:.1f} | {tokens[0] / tb:.1f} | {t1 / tb:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
