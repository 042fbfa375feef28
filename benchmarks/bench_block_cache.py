"""Block-causal prefix KV cache vs full-window recompute, on a random SDAR model.

    python benchmarks/bench_block_cache.py [--prompt 512] [--block 32] [--max-tokens 128] [--runs 3]

The model is a larger-than-fixture random SDAR (Qwen3 body) built on the fly with the test
fixture's own builder (tests/fixtures/sdar.py: exact HF key names, confident head). Each setting
runs once as a warm-up, then --runs times; the table quotes medians. Per forward it records the
wall time of the model call (evaluated), so "ms / step" is the model's share of a denoising step.
The machine is shared and noisy: compare rows of one run, never absolute numbers across machines.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mlx_dllm_models.engine import FullRecompute, MaskedBlockDecoder  # noqa: E402
from mlx_dllm_models.engine.block_cache import PrefixCache  # noqa: E402
from mlx_dllm_models.engine.contracts import DecoderInputs  # noqa: E402
from mlx_dllm_models.models import sdar  # noqa: E402
from mlx_dllm_models.settings import resolve_settings  # noqa: E402

SIZE = dict(VOCAB=4096, HIDDEN=384, HEADS=6, KV_HEADS=2, HEAD_DIM=64, LAYERS=6)


def build_model(block):
    from fixtures import sdar as fixture

    for name, value in dict(SIZE, BLOCK_SIZE=block).items():
        setattr(fixture, name, value)
    cfg = fixture._config(moe=False)
    cfg.update(intermediate_size=1024, max_position_embeddings=4096)
    weights = fixture._tensors(cfg, np.random.default_rng(0))
    model = sdar.Model(sdar.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize({k: mx.array(v) for k, v in weights.items()}).items()))
    mx.eval(model.parameters())
    return model, cfg


def timed(backend_cls):
    class Timed(backend_cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.times = []  # (input tokens, seconds) per denoising forward
            self.prefill_s = 0.0

        def prefill(self, x):
            tic = time.perf_counter()
            super().prefill(x)
            self.prefill_s = time.perf_counter() - tic

        def block_logits(self, x, start, stop):
            committed = getattr(getattr(self, "cache", None), "committed", 0)
            tic = time.perf_counter()
            out = super().block_logits(x, start, stop)
            mx.eval(out)
            tokens = (
                x.shape[1]
                if backend_cls is FullRecompute
                else -(-stop // self.block) * self.block - committed
            )
            self.times.append((tokens, time.perf_counter() - tic))
            return out

    return Timed


def run_once(model, prompt, settings, backend_cls):
    inputs = DecoderInputs(model.diffusion_spec, settings)
    decoder = MaskedBlockDecoder(model, inputs, backend=timed(backend_cls))
    tic = time.perf_counter()
    blocks = 0
    for event in decoder.run([prompt]):
        blocks += type(event).__name__ == "BlockEvent"
    wall = time.perf_counter() - tic
    b = decoder.backend
    steps = [t for _, t in b.times]
    single = [t for n, t in b.times if n == settings.block_length]
    folded = [t for n, t in b.times if n == 2 * settings.block_length]
    return {
        "wall": wall,
        "nfe": decoder.nfe,
        "denoise": len(b.times),
        "blocks": blocks,
        "step_ms": 1000 * statistics.median(steps),
        "single_ms": 1000 * statistics.median(single) if single else float("nan"),
        "folded_ms": 1000 * statistics.median(folded) if folded else float("nan"),
        "prefill_ms": 1000 * b.prefill_s,
        "saved": getattr(b, "commits_saved", 0),
        "folds": getattr(b, "commits_folded", 0),
    }


def median_of(runs, key):
    return statistics.median(r[key] for r in runs)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    model, cfg = build_model(args.block)
    prompt = np.random.default_rng(1).integers(0, 256, args.prompt).tolist()
    samplers = [
        ("quota, 8 steps", dict(sampler="quota", steps=8)),
        ("threshold 0.85", dict(sampler="threshold", threshold=0.85, steps=args.block)),
    ]
    print(
        f"random SDAR: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads of {cfg['head_dim']}, "
        f"vocab {cfg['vocab_size']}; prompt {args.prompt} tokens, block {args.block}, "
        f"max_tokens {args.max_tokens}; median of {args.runs} runs after a warm-up; "
        f"mlx {mx.__version__}, device {mx.default_device()}"
    )
    print()
    print(
        "| sampler | mode | ms / step | speed-up | forwards / block | tokens / forward | prefill ms | total s | commit forwards saved |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    detail = []
    modes = (("full recompute", FullRecompute), ("prefix cache", PrefixCache))
    for label, extra in samplers:
        settings = resolve_settings(
            model.diffusion_spec, dict(max_tokens=args.max_tokens, block_length=args.block, **extra)
        )
        for _, cls in modes:
            run_once(model, prompt, settings, cls)  # warm-up
        # Alternate the modes so that the shared machine's load hits both alike.
        runs = {mode: [] for mode, _ in modes}
        for _ in range(args.runs):
            for mode, cls in modes:
                runs[mode].append(run_once(model, prompt, settings, cls))
        full_ms = median_of(runs["full recompute"], "step_ms")
        assert runs["full recompute"][-1]["denoise"] == runs["prefix cache"][-1]["denoise"]
        for mode, cls in modes:
            r, step_ms = runs[mode][-1], median_of(runs[mode], "step_ms")
            print(
                f"| {label} | {mode} | {step_ms:.1f} | {full_ms / step_ms:.1f}x | {r['denoise'] / r['blocks']:.2f} | "
                f"{args.max_tokens / r['nfe']:.2f} | {median_of(runs[mode], 'prefill_ms'):.0f} | "
                f"{median_of(runs[mode], 'wall'):.2f} | {r['saved']} |"
            )
        cached = runs["prefix cache"]
        detail.append(
            (
                label,
                median_of(cached, "single_ms"),
                median_of(cached, "folded_ms"),
                cached[-1]["folds"],
                cached[-1]["saved"],
            )
        )
    print()
    print(
        "| sampler | ms / one-block step | ms / folded step (finished block + open block) | folds | commit forwards saved |"
    )
    print("|---|---:|---:|---:|---:|")
    for label, single, folded, folds, saved in detail:
        print(f"| {label} | {single:.1f} | {folded:.1f} | {folds} | {saved} |")


if __name__ == "__main__":
    main()
