"""This package against mlx-vlm (the peer that runs LLaDA2 and Nemotron-Labs-Diffusion today), on
the same random weights, in the same process, at batch 1.

    python benchmarks/bench_vs_mlx_vlm.py [--prompt 128] [--max-tokens 128] [--pairs 10]

The checkpoints are larger-than-fixture random models written by the test fixtures' own builders
(exact HF layout), loaded by each package through its own loader. Both sides decode at temperature
0 with the same sampler and settings (each row says which). After a warm-up of each, the two
engines alternate run by run for --pairs pairs (which one goes first alternates too), so that the
machine's load hits both alike; the table reports forwards (NFE), tokens, tok/s, the ratio of the
total times (mlx-vlm's over ours: above 1, ours is faster), the spread of the per-pair ratios
(median, min-max) and a bootstrap 95% interval of the ratio of totals (pairs resampled), and
whether the tokens agree. The batched rows (ours only: mlx-vlm decodes one row) alternate the
same 4 prompts one by one against one batch, the same way.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import mlx_dllm_models_hook  # noqa: E402,F401
from mlx_dllm_models import batch_generate_diffusion, load, stream_generate_diffusion  # noqa: E402
from mlx_dllm_models.tiny import write_checkpoint  # noqa: E402


def build_llada2(path):
    from fixtures import llada2 as fx

    cfg = fx.config(head_dim=64)
    cfg.update(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=6,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        rotary_dim=32,
        max_position_embeddings=4096,
    )
    write_checkpoint(path, cfg, soften_head(fx.tensors(cfg), "lm_head.weight"))
    _copy_tokenizer(fx, path)
    return path, cfg


def soften_head(tensors, name, factor=0.3):
    """The fixtures' heads are sharpened for tiny models; at this width they would push many
    confidences to float32's 1.0, where ties make any two implementations order positions
    differently. A softer head keeps the comparison about speed."""
    tensors[name] = tensors[name] * factor
    return tensors


def _copy_tokenizer(fx, path):
    with tempfile.TemporaryDirectory() as tmp:
        small = fx.build(Path(tmp) / "small")
        for f in small.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                (Path(path) / f.name).write_bytes(f.read_bytes())


def build_nemotron(path):
    from fixtures import nemotron as fx

    for k, v in dict(
        HIDDEN=512, HEADS=8, KV_HEADS=2, HEAD_DIM=64, LAYERS=6, INTERMEDIATE=1536, ORIGINAL_MAX=4096
    ).items():
        setattr(fx, k, v)
    cfg = fx.config()
    write_checkpoint(path, cfg, soften_head(fx.tensors(), "diffusion_head.weight"))
    _copy_tokenizer(fx, path)
    return path, cfg


def vlm_model(family, path):
    cfg = json.loads((Path(path) / "config.json").read_text())
    if family == "llada2":
        from mlx_vlm.models.llada2_moe import Model
        from mlx_vlm.models.llada2_moe.config import ModelConfig
    else:
        from mlx_vlm.models.nemotron_labs_diffusion import Model, ModelConfig
    model = Model(ModelConfig.from_dict(cfg))
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    model.forward_calls = count_forwards(model)
    return model


def run_ours(model, tok, prompt, settings):
    tic = time.perf_counter()
    out, last = [], None
    for last in stream_generate_diffusion(model, tok, prompt, **settings):
        out.extend(last.tokens)
    return out, last.nfe, time.perf_counter() - tic


def count_forwards(vlm):
    """mlx-vlm does not report forwards for LLaDA2: count calls of its transformer body."""
    inner = vlm.language_model.model
    cls = type(inner)
    calls = [0]

    def counted(self, *a, **k):
        calls[0] += 1
        return cls.__call__(self, *a, **k)

    inner.__class__ = type(cls.__name__, (cls,), {"__call__": counted})
    return calls


def run_vlm(model, prompt, kw, eos):
    calls = model.forward_calls
    calls[0] = 0
    tic = time.perf_counter()
    out = model.language_model.generate(mx.array([prompt]), **kw)
    mx.eval(out)
    wall = time.perf_counter() - tic
    toks = [int(t) for t in np.array(out).reshape(-1)]
    cut = next((i for i, t in enumerate(toks) if t in eos), None)
    toks = toks if cut is None else toks[:cut]
    return toks, calls[0], wall


def interleaved(ours, theirs, pairs, seed=0):
    """Both callables (each -> (tokens, nfe, seconds)) after a warm-up each, alternating run by
    run over `pairs` pairs; returns (ours' last, theirs' last, summary dict)."""
    ours(), theirs()
    a_s, b_s = [], []
    for i in range(pairs):
        if i % 2 == 0:
            a, b = ours(), theirs()
        else:
            b, a = theirs(), ours()
        a_s.append(a[2])
        b_s.append(b[2])
    ratios = sorted(b / a for a, b in zip(a_s, b_s))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, pairs, size=(2000, pairs))
    boot = np.sort(np.array(b_s)[picks].sum(1) / np.array(a_s)[picks].sum(1))
    summary = dict(
        a_s=sum(a_s) / pairs,
        b_s=sum(b_s) / pairs,
        ratio=sum(b_s) / sum(a_s),
        median=statistics.median(ratios),
        low=ratios[0],
        high=ratios[-1],
        ci=(boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]),
    )
    return a, b, summary


HEADER = (
    "| family, settings | engines | NFE | tokens | tok/s | time ratio (totals) "
    "| per-pair median [min, max] | bootstrap 95% | tokens equal |"
)


def row(label, engines, a, b, r, same):
    nfe = f"{a[1]:.0f} / {b[1]:.0f}"
    toks = f"{len(a[0])} / {len(b[0])}"
    rate = f"{len(a[0]) / r['a_s']:.1f} / {len(b[0]) / r['b_s']:.1f}"
    return (
        f"| {label} | {engines} | {nfe} | {toks} | {rate} | {r['ratio']:.3f} "
        f"| {r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}] "
        f"| {r['ci'][0]:.3f}-{r['ci'][1]:.3f} | {same} |"
    )


def settings_for(family, spec, max_tokens):
    """(label, ours' settings, mlx-vlm's generate kwargs) of each comparison: the same sampler."""
    if family == "llada2":
        ours = dict(max_tokens=max_tokens, block_length=32, steps=32)
        vlm = dict(block_length=32, steps=32, gen_length=max_tokens, eos_early_stop=True)
        return [
            (
                "LLaDA2, block 32, threshold 0.95",
                dict(ours, sampler="threshold", threshold=0.95),
                dict(vlm, threshold=0.95),
            )
        ]
    # Nemotron at its trained block size (mlx-vlm ignores the checkpoint's: pass it).
    block = spec.trained_block_length
    ours = dict(max_tokens=max_tokens, block_length=block, steps=block)
    vlm = dict(
        block_length=block,
        steps=block,
        gen_length=max_tokens,
        eos_early_stop=True,
        sampler="native",
    )
    return [
        (
            f"Nemotron, block {block}, quota: one token a step",
            dict(ours, sampler="quota"),
            dict(vlm, threshold=None),
        ),
        (
            f"Nemotron, block {block}, threshold 0.9 (our default)",
            dict(ours, sampler="threshold", threshold=0.9),
            dict(vlm, threshold=0.9),
        ),
    ]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--families", nargs="+", default=["llada2", "nemotron"])
    ap.add_argument("--no-batch", action="store_true", help="skip the batch-of-4 rows")
    args = ap.parse_args()
    import mlx_vlm

    rng = np.random.default_rng(0)
    print(
        f"prompt {args.prompt} tokens, max_tokens {args.max_tokens}, temperature 0, batch 1; "
        f"{args.pairs} alternating pairs after a warm-up; mlx {mx.__version__}, "
        f"mlx-vlm {mlx_vlm.__version__}"
    )
    print(HEADER)
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    builders = {"llada2": build_llada2, "nemotron": build_nemotron}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            path, cfg = builders[family](Path(tmp) / family)
            model, tok = load(path)
            vlm = vlm_model(family, path)
            spec = model.diffusion_spec
            # byte tokens only: ids below 10 include pad, which mlx-vlm masks out of a prompt
            prompt = [int(t) for t in rng.integers(10, 250, size=args.prompt)]
            eos = set(spec.eos_token_ids)
            comparisons = settings_for(family, spec, args.max_tokens)
            for i, (label, ours_kw, vlm_kw) in enumerate(comparisons):
                a, b, r = interleaved(
                    lambda: run_ours(model, tok, prompt, ours_kw),
                    lambda: run_vlm(vlm, prompt, vlm_kw, eos),
                    args.pairs,
                )
                same = "yes" if a[0] == b[0][: len(a[0])] else "no"
                print(row(label, "ours / mlx-vlm", a, b, r, same), flush=True)
                if args.no_batch or i > 0:  # the batch rows: with each family's first sampler
                    continue
                # Batch > 1, which mlx-vlm refuses: the same 4 prompts one by one vs at once.
                prompts = [prompt] + [
                    [int(t) for t in rng.integers(10, 250, size=args.prompt)] for _ in range(3)
                ]

                def many():
                    tic = time.perf_counter()
                    out = batch_generate_diffusion(model, tok, prompts, **ours_kw)
                    return out.tokens, out.nfe, time.perf_counter() - tic

                def one():
                    runs = [run_ours(model, tok, p, ours_kw) for p in prompts]
                    return [r[0] for r in runs], sum(r[1] for r in runs), sum(r[2] for r in runs)

                m, o, r = interleaved(many, one, args.pairs)
                flat = (sum(m[0], []), m[1], m[2]), (sum(o[0], []), o[1], o[2])
                same = "yes" if m[0] == o[0] else "no"
                print(row(label, "ours: batch of 4 / one by one", *flat, r, same), flush=True)


if __name__ == "__main__":
    main()
