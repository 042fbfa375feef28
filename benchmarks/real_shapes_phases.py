"""The measured phases of benchmarks/bench_real_shapes.py after the checkpoint is written: plain
mlx-lm's convert and load (peak RSS, seconds, bytes), and generation through the engine's decoder
with each forward timed by a spy (that script's docstring says what each reports)."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from real_shapes_checkpoints import write_checkpoint

# New tokens per run: one or two blocks of the family's default is enough for a few steps; the
# bidirectional families recompute prompt + max_tokens every step, so it sets their cost.
MAX_TOKENS = 64


def resident_set():
    """(current, peak) resident set of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def _du(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _weights(path):
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def phase_write(key, path):
    info = write_checkpoint(key, path)
    info.update(phase="write", rss_peak=resident_set()[1], disk=_du(path))
    return info


def phase_convert(ckpt, out):
    """`python -m mlx_lm convert -q` in a child process; its own peak RSS from wait4."""
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "convert",
        "--hf-path",
        str(ckpt),
        "--mlx-path",
        str(out),
        "-q",
    ]
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"convert failed ({proc.returncode}):\n{output[-3000:]}")
    shard = max(f.stat().st_size for f in Path(ckpt).glob("*.safetensors"))
    return dict(
        phase="convert",
        seconds=time.perf_counter() - tic,
        rss_peak=usage.ru_maxrss * 1024,
        input_bytes=_weights(ckpt),
        largest_input_shard=shard,
        output_bytes=_weights(out),
        output_disk=_du(out),
        output_tail=output[-400:],
    )


def phase_load(out):
    """Plain mlx_lm.load in this (fresh) process."""
    import mlx.core as mx
    import mlx_lm
    import mlx_lm.utils
    from mlx.utils import tree_flatten

    # The tokenizer (a 150-260k entry vocabulary) is loaded after the model: its RSS is recorded
    # apart, as part of the fixed allowance.
    marks = {}
    real = mlx_lm.utils.load_tokenizer

    def load_tokenizer(*a, **k):
        marks["model"] = resident_set()
        tok = real(*a, **k)
        marks["tokenizer"] = resident_set()
        return tok

    mlx_lm.utils.load_tokenizer = load_tokenizer
    base = resident_set()[0]
    tic = time.perf_counter()
    model, _ = mlx_lm.load(str(out))
    seconds = time.perf_counter() - tic
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rss, peak = resident_set()
    tok_delta = marks["tokenizer"][0] - marks["model"][0]
    return dict(
        phase="load",
        seconds=seconds,
        rss_before=base,
        rss_model=marks["model"][0],
        rss_peak_model=marks["model"][1],
        tokenizer_rss=tok_delta,
        rss_after=rss,
        rss_peak=peak,
        model_ratio=(marks["model"][1] - base) / weights,
        mlx_peak=mx.get_peak_memory(),
        mlx_active=mx.get_active_memory(),
        weight_bytes=weights,
        ratio=(peak - base - tok_delta) / weights,
    )


def _kv_dims(model):
    """(layers, kv_heads, head_dim) the K/V of every layer take."""
    a = model.args
    kv = getattr(a, "num_key_value_heads", None) or getattr(a, "n_kv_heads", None)
    heads = getattr(a, "num_attention_heads", None) or getattr(a, "n_heads", None)
    hidden = getattr(a, "hidden_size", None) or getattr(a, "d_model", None)
    head_dim = getattr(a, "head_dim", None) or hidden // heads
    return len(model.layers), kv, head_dim


def _vocab(model):
    a = model.args
    return getattr(a, "embedding_size", None) or getattr(a, "vocab_size")


def random_prompt(model, rng, n):
    """n random ordinary ids (no special token; above mlx-vlm's pad ids)."""
    spec = model.diffusion_spec
    specials = set(spec.eos_token_ids) | {spec.mask_token_id}
    vocab = _vocab(model)
    low, high = (1000, 30000) if vocab > 40000 else (10, min(250, vocab))
    out = []
    while len(out) < n:
        t = int(rng.integers(low, high))
        if t not in specials:
            out.append(t)
    return out


class Spy:
    """Times each forward the engine issues: its logits and the caches' K/V evaluated."""

    def __init__(self, model):
        import mlx.core as mx

        self.calls = []
        self.outside = 0  # MLX's peak between forwards (the engine's own arrays)
        self.cls = type(model)
        real = self.cls.__call__
        self.real = real
        spy = self

        def timed(self, inputs, cache=None, mask=None, head_span=None):
            if isinstance(mask, mx.array):
                mx.eval(mask)
            spy.outside = max(spy.outside, mx.get_peak_memory())
            mx.reset_peak_memory()
            tic = time.perf_counter()
            out = real(self, inputs, cache=cache, mask=mask, head_span=head_span)
            kv = []
            for c in cache if isinstance(cache, (list, tuple)) else []:
                kv += [getattr(c, n) for n in ("keys", "values") if getattr(c, n, None) is not None]
            mx.eval(out, kv)
            bare = time.perf_counter() - tic
            peak = mx.get_peak_memory()
            mx.reset_peak_memory()
            spy.calls.append(
                dict(
                    at=tic,
                    bare=bare,
                    peak=peak,
                    width=inputs.shape[1],
                    rows=inputs.shape[0],
                    logits=tuple(out.shape),
                    head_span=head_span,
                )
            )
            return out

        self.cls.__call__ = timed

    def close(self):
        self.cls.__call__ = self.real


def decode_steps(model, tok, prompt, settings, steps):
    """The engine's decoder over `prompt` until steps + 1 denoising steps are done: per step its
    forward (the spy's record), and the committed count after each step."""
    import mlx.core as mx

    from mlx_dllm_models.engine.base import StepEvent
    from mlx_dllm_models.generate import stream_events

    s, ids, decoder = stream_events(model, tok, [prompt], **settings)
    mask = model.diffusion_spec.mask_token_id
    spy = Spy(model)
    step_at, canvases = [], []
    tic = time.perf_counter()
    try:
        for event in decoder.run(ids):
            if isinstance(event, StepEvent):
                step_at.append(len(spy.calls) - 1)
                canvases.append(event.generated)
                if len(step_at) > steps:
                    break
    finally:
        spy.close()
    wall = time.perf_counter() - tic
    outside = max(spy.outside, mx.get_peak_memory())
    calls = spy.calls
    first = step_at[0]
    prefill = calls[:first]
    fwd = [calls[i] for i in step_at]
    step_s = [b["at"] - a["at"] for a, b in zip(fwd, fwd[1:])]
    bare = [c["bare"] for c in fwd[:-1]]
    committed = [int((c != mask).sum().item()) for c in canvases]
    return dict(
        settings={k: v for k, v in s.items() if isinstance(v, (int, float, str, bool, type(None)))},
        prompt_ids=len(ids[0]),
        prefill_s=sum(c["bare"] for c in prefill),
        prefill_forwards=len(prefill),
        prefill_peak=max((c["peak"] for c in prefill), default=0),
        step_peak=max(c["peak"] for c in fwd),
        outside_peak=outside,
        peak=max([outside] + [c["peak"] for c in calls]),
        steps=len(step_s),
        step_s=statistics.median(step_s),
        bare_s=statistics.median(bare),
        step_over_bare=statistics.median(step_s) / statistics.median(bare),
        step_widths=sorted({c["width"] for c in fwd}),
        tokens_per_forward=committed[-2] / len(step_s) if len(step_s) else None,
        committed=committed,
        max_logit_rows=max(c["logits"][1] for c in calls),
        logits_shapes=sorted({c["logits"] for c in calls}),
        head_spans=sorted({str(c["head_span"]) for c in calls}),
        tokens=[int(t) for t in mx.array(canvases[-1]).reshape(-1).tolist()],
        wall=wall,
    )


def load_ours(out):
    """mlx_dllm_models.load, and how many layers it put on the CPU's float32-matmul path with
    what one forward then holds widened."""
    from mlx_dllm_models import load

    model, tok = load(str(out))
    try:
        from mlx_dllm_models.models import cpu_layers

        swapped = sum(type(m) in cpu_layers.PARENTS for _, m in model.named_modules())
        widened = cpu_layers.widened_bytes(model) if swapped else 0
    except ImportError:
        swapped, widened = None, 0
    return model, tok, swapped, widened


def phase_generate(out, key, prompts, steps):
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    base = resident_set()[0]
    model, tok, swapped, widened = load_ours(out)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    layers, kv_heads, head_dim = _kv_dims(model)
    vocab = _vocab(model)
    act_bytes = 4 if swapped else 2
    rng = np.random.default_rng(0)
    rows = []
    for n in prompts:
        prompt = random_prompt(model, rng, n)
        settings = dict(max_tokens=MAX_TOKENS, temperature=0)
        mx.clear_cache()
        mx.reset_peak_memory()
        r = decode_steps(model, tok, prompt, settings, steps)
        peak = r["peak"]
        block = r["settings"].get("block_length") or MAX_TOKENS
        tokens = r["prompt_ids"] + MAX_TOKENS
        kv = 2 * layers * kv_heads * head_dim * act_bytes * tokens
        logits = block * vocab * 4
        theory = weights + kv + logits
        r.update(
            prompt=n,
            peak=peak,
            theory=theory,
            kv_theory=kv,
            logits_theory=logits,
            peak_over_theory=peak / theory,
            peak_over_theory_and_widening=peak / (theory + widened),
            canvas=tokens,
            full_canvas_logits=r["max_logit_rows"] >= tokens,
        )
        r.pop("tokens")
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    result = dict(
        phase="generate",
        key=key,
        cpu_float32_matmuls=swapped,
        widened_bytes=widened,
        weight_bytes=weights,
        kv_dims=(layers, kv_heads, head_dim),
        act_bytes=act_bytes,
        vocab=vocab,
        rss_before=base,
        rss_peak=resident_set()[1],
        rows=rows,
    )
    return result
