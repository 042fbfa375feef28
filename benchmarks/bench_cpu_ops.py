"""Why a long-prompt forward costs more in mlx than in PyTorch on a Linux CPU (issue 14 §2).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/bench_cpu_ops.py [--positions 487] [--threads 1]

Times, in one process and on the same arrays, the pieces of the embedded default's forward over a
prompt of `--positions` tokens (4 heads of 32, 4 layers): the elementwise exp of one layer's
attention scores (heads x positions x positions), an add of the same size, the whole attention of
one layer (mx.fast.scaled_dot_product_attention against torch's), and the model's forward (mlx
against a transformers Llama holding the same weights, as bench_fast_dllm.py's PyTorch row). Medians
of 10 runs after 3 warm-ups; torch runs with `--threads` threads.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def median_ms(fn, runs=10, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def main():
    import mlx.core as mx
    import torch

    import mlx_dllm_models_hook  # noqa: F401
    from mlx_dllm_models.default import default_checkpoint
    from mlx_dllm_models.loader import load

    p = argparse.ArgumentParser()
    p.add_argument("--positions", type=int, default=487)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    L = a.positions

    model, _ = load(default_checkpoint())
    heads, head_dim = model.args.n_heads, model.args.d_model // model.args.n_heads
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((heads, L, L)).astype(np.float32)
    qkv = [rng.standard_normal((1, heads, L, head_dim)).astype(np.float32) for _ in range(3)]
    m_scores, t_scores = mx.array(scores), torch.from_numpy(scores)
    m_qkv, t_qkv = [mx.array(x) for x in qkv], [torch.from_numpy(x) for x in qkv]
    mx.eval(m_scores, *m_qkv)
    scale = head_dim**-0.5

    rows = [
        ("exp of one layer's scores", lambda: mx.eval(mx.exp(m_scores)), lambda: t_scores.exp()),
        ("add of the same size", lambda: mx.eval(m_scores + 1), lambda: t_scores + 1),
        (
            "attention, one layer",
            lambda: mx.eval(mx.fast.scaled_dot_product_attention(*m_qkv, scale=scale)),
            lambda: torch.nn.functional.scaled_dot_product_attention(*t_qkv, scale=scale),
        ),
    ]

    # bench_fast_dllm.py's PyTorch row: a transformers Llama with the default's weights.
    from reference.llada_torch import torch_forward

    ids = rng.integers(0, 250, (1, L))
    forward, m_ids = torch_forward(default_checkpoint()), mx.array(ids)
    rows.append(("model forward", lambda: mx.eval(model(m_ids)), lambda: forward(ids)))
    print(f"{L} positions, {heads} heads of {head_dim}; torch {a.threads} thread(s)")
    print("| operation | mlx ms | torch ms | mlx / torch |")
    print("|---|---:|---:|---:|")
    for name, m_fn, t_fn in rows:
        m_ms, t_ms = median_ms(m_fn), median_ms(t_fn)
        print(f"| {name} | {m_ms:.2f} | {t_ms:.2f} | {m_ms / t_ms:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
