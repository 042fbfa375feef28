"""Real shapes, measured (issue #25 section 3): a random-weight checkpoint at a published config's
exact shapes, in the exact Hugging Face layout, through plain mlx-lm's convert and load, then
generation, with the memory and the step cost measured.

    python benchmarks/bench_real_shapes.py run sdar-1.7b [--work DIR] [--prompts 512] [--steps 3]
    python benchmarks/bench_real_shapes.py write nemotron-3b DIR      # the checkpoint only
    python benchmarks/bench_real_shapes.py list                       # the sizes and their sources

One checkpoint at a time, each phase in its own subprocess so that each peak is its own:

1. write: config.json (and generation_config.json) from tests/data/<checkpoint>/, the real weight
   names (model.safetensors.index.json from tests/data where it was found, else the family's test
   fixture's names repeated over the real layer count), each tensor's shape from the family's
   model built lazily at the real config (the shape `sanitize` maps it onto; checked: `sanitize` of
   lazy placeholders gives exactly the model's parameters, names and shapes), written one tensor at
   a time in bfloat16 into safetensors shards of about 2 GB with model.safetensors.index.json.
   Values: uniform noise of variance 1 / fan_in, norms at 1, biases 0, embeddings of variance 1
   (the mask token's row at 0.05 of that, as the fixtures), an untied output head scaled so that
   a logit has a standard deviation of HEAD_LOGIT_STD (predictions far from uniform). A
   tokenizer in the fixtures' form (one token per byte, no merges) holding the checkpoint's special
   tokens at their real ids, filled to the real vocabulary size; the real chat template where
   tests/data has it. No real tokenizer.json exists here.
2. convert: `python -m mlx_lm convert --hf-path <ckpt> --mlx-path <out> -q` (4 bit, group 64),
   the peak RSS of that process (os.wait4), seconds, bytes on disk of input and output.
3. load: plain `mlx_lm.load(out)` in a fresh interpreter: RSS after the imports, peak RSS, MLX's
   peak, the weight bytes held (parameters' nbytes).
4. generate, at each --prompts length: `mlx_dllm_models.load` (which, while the float32-matmul CPU
   path of issue #28 is in the tree, turns it on: the row says), a prompt of random ordinary ids,
   the family's default settings (only max_tokens fixed, see MAX_TOKENS), the engine's decoder
   run for the prefill and --steps + 1 denoising steps. A spy on the model times each forward (its
   logits and the caches' K/V evaluated, after the engine's mask was), records its input width,
   head_span and logits shape. Reported: prefill seconds, the median step (from one denoising
   forward's call to the next one's) against the median bare forward of those steps, tokens
   committed per denoising forward in those steps, MLX's peak memory over the run (reset after
   load) against weights + the K/V the layout needs in theory (2 x layers x kv_heads x head_dim x
   bytes x (prompt + max_tokens), bytes of the activations' dtype) + one block's float32 logits,
   and the largest logits any forward returned (rows x vocabulary) against the full canvas.
5. mlx-vlm (LLaDA2.x, Nemotron), in a process of its own after generate (its JSON line apart, so
   that a run killed there, e.g. by the OOM killer on a shared machine, keeps the generation
   rows; `run --prompts` with no lengths measures this phase only): mlx-vlm's model built from
   the same config and given the same 4-bit arrays (no copy: the arrays are shared); one block
   decoded by each at temperature 0 with the same sampler, alternating runs: tok/s ratio and
   whether the tokens agree. mlx-vlm's layers are put on the same CPU matmul path as ours when
   ours is on it (cpu_layers' variants; its own QuantizedSwitchLinear is given ours' class), else
   a 4-bit matmul on this CPU would be compared with a float32 one.

Run with OpenBLAS preloaded (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3),
as the other benchmarks here: float32 matmuls are about 10x faster with it on this CPU.
Each phase appends a JSON line to <work>/results.jsonl; `run` deletes the checkpoint and its
conversion afterwards (--keep 4bit keeps the conversion for a later run that measures generation
only; --keep all keeps both). Run only one at a time on a shared machine.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from real_shapes_checkpoints import CHECKPOINTS, write_checkpoint  # noqa: E402
from real_shapes_phases import phase_convert, phase_generate, phase_load, phase_write  # noqa: E402
from real_shapes_vlm import phase_vlm  # noqa: E402

GB = 1e9


# ------------------------------------------------------------------------------------ driver


def _child(args, log):
    """This script's phase in a fresh interpreter; its JSON line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *map(str, args)]
    env = dict(os.environ)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"phase {args[0]} failed ({proc.returncode})")
    line = proc.stdout.decode().strip().splitlines()[-1]
    with open(log, "a") as f:
        f.write(line + "\n")
    return json.loads(line)


def run(key, work, prompts, steps, vlm_pairs, keep="none"):
    """keep: "none" (delete both folders at the end), "4bit" (keep the conversion: a later run
    with the same work folder reuses it and measures generation only), "all"."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt, out = work / f"{key}-hf", work / f"{key}-4bit"
    log = work / "results.jsonl"
    load = os.getloadavg()
    with open(log, "a") as f:
        f.write(json.dumps(dict(phase="start", key=key, loadavg=load, at=time.time())) + "\n")
    reuse = (out / "config.json").exists() and keep != "none"
    try:
        if not reuse:
            _child(["_write", key, ckpt], log)
            if out.exists():
                shutil.rmtree(out)
            _child(["_convert", ckpt, out], log)
            if keep != "all":
                shutil.rmtree(ckpt)
            _child(["_load", out], log)
        if prompts:
            _child(["_generate", out, key, "--steps", steps, "--prompts", *prompts], log)
        if vlm_pairs and CHECKPOINTS[key].get("vlm"):
            _child(["_vlm", out, key, "--pairs", vlm_pairs], log)
    finally:
        with open(log, "a") as f:
            f.write(json.dumps(dict(phase="end", key=key, loadavg=os.getloadavg())) + "\n")
        for p, kept in ((ckpt, keep == "all"), (out, keep != "none")):
            if p.exists() and not kept:
                shutil.rmtree(p)


def _records(files):
    """key -> {phase: record} from results files (the last record of each phase wins)."""
    out, key = {}, None
    for f in files:
        for line in Path(f).read_text().splitlines():
            d = json.loads(line)
            if d["phase"] == "start":
                key = d["key"]
            rec = out.setdefault(key, {})
            if d["phase"] == "generate" and "generate" in rec:
                # Rows of several runs: one per prompt length, the later run's where both have it.
                rows = {r["prompt"]: r for r in rec["generate"]["rows"] + d["rows"]}
                d = dict(d, rows=sorted(rows.values(), key=lambda r: r["prompt"]))
                d.setdefault("vlm", rec["generate"].get("vlm"))
            if d["phase"] in ("start", "end"):
                rec.setdefault("loadavg", []).append(d["loadavg"][0])
            rec[d["phase"]] = d
    return out


def table(files):
    """The markdown tables of BENCHMARKS.md from results files."""
    g = GB
    recs = _records(files)
    print(
        "| checkpoint | HF bf16 GB (shards) | 4-bit GB | convert s | convert peak RSS GB "
        "(largest shard) | load: peak RSS - base - tokenizer GB / weights GB "
        "| load average (1 min, at starts and ends) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for key, r in recs.items():
        w, c, lo = r.get("write"), r.get("convert"), r.get("load")
        if not (w and c and lo):
            continue
        extra = lo["rss_peak"] - lo["rss_before"] - lo["tokenizer_rss"]
        print(
            f"| {key} | {w['bytes'] / g:.2f} ({w['shards']}) | {c['output_bytes'] / g:.2f} "
            f"| {c['seconds']:.0f} | {c['rss_peak'] / g:.2f} ({c['largest_input_shard'] / g:.2f}) "
            f"| {extra / g:.2f} / {lo['weight_bytes'] / g:.2f} = {lo['ratio']:.3f} "
            f"| {', '.join(f'{x:.1f}' for x in r['loadavg'])} |"
        )
    print()
    print(
        "| checkpoint | prompt | settings | prefill s (s / token) | step s | bare forward s "
        "| ratio | tokens / forward | MLX peak GB | theory GB (K/V) | peak / theory "
        "| + widening | largest logits rows / canvas |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in recs.items():
        gen = r.get("generate")
        if not gen:
            continue
        for row in gen["rows"]:
            st = row["settings"]
            label = st.get("sampler")
            if label in ("threshold", "llada2"):
                label += f" {st['threshold']}"
            if st.get("alg"):
                label += f" ({st['alg']})"
            label += f", block {st['block_length']}, {st['steps']} steps, cache {st.get('cache')}"
            prefill = "none (full recompute)"
            if row["prefill_forwards"]:
                prefill = f"{row['prefill_s']:.0f} ({row['prefill_s'] / row['prompt']:.3f})"
            print(
                f"| {key} | {row['prompt']} | {label} | {prefill} | {row['step_s']:.2f} "
                f"| {row['bare_s']:.2f} | {row['step_over_bare']:.3f} "
                f"| {row['tokens_per_forward']:.2f} | {row['peak'] / g:.2f} "
                f"| {row['theory'] / g:.2f} ({row['kv_theory'] / g:.2f}) "
                f"| {row['peak_over_theory']:.2f} | {row['peak_over_theory_and_widening']:.2f} "
                f"| {row['max_logit_rows']} / {row['canvas']} |"
            )
    print()
    print(
        "| checkpoint | settings | prompt | forwards ours / mlx-vlm | s ours / mlx-vlm "
        "| tok/s ratio | tokens equal |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for key, r in recs.items():
        # Older results files carry it inside the generate record.
        v = r.get("vlm") or (r.get("generate") or {}).get("vlm")
        if not v:
            continue
        print(
            f"| {key} | {v['settings']} | {v['prompt']} | {v['ours_nfe']} / "
            f"{v.get('vlm_forwards', '?')} | {v['ours_s']:.1f} / {v['vlm_s']:.1f} "
            f"| {v['tok_s_ratio']:.2f} | {'yes' if v['tokens_equal'] else 'no'} |"
        )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("key", choices=CHECKPOINTS)
    r.add_argument("--work", default="/tmp/bench_real_shapes")
    # No lengths: no generate phase (with --keep 4bit, the mlx-vlm side-by-side alone).
    r.add_argument("--prompts", nargs="*", type=int, default=[512])
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--vlm-pairs", type=int, default=2)
    r.add_argument("--keep", choices=("none", "4bit", "all"), default="none")
    w = sub.add_parser("write")
    w.add_argument("key", choices=CHECKPOINTS)
    w.add_argument("path")
    sub.add_parser("list")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    p = sub.add_parser("_write")
    p.add_argument("key")
    p.add_argument("path")
    p = sub.add_parser("_convert")
    p.add_argument("ckpt")
    p.add_argument("out")
    p = sub.add_parser("_load")
    p.add_argument("out")
    p = sub.add_parser("_generate")
    p.add_argument("out")
    p.add_argument("key")
    p.add_argument("--prompts", nargs="+", type=int, default=[512])
    p.add_argument("--steps", type=int, default=3)
    p = sub.add_parser("_vlm")
    p.add_argument("out")
    p.add_argument("key")
    p.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()

    if args.cmd == "list":
        for key, entry in CHECKPOINTS.items():
            print(key, entry["data"], "derived" if "derive" in entry else "")
        return
    if args.cmd == "table":
        table(args.files)
        return
    if args.cmd == "run":
        run(args.key, args.work, args.prompts, args.steps, args.vlm_pairs, args.keep)
        return
    if args.cmd == "write":
        print(json.dumps(write_checkpoint(args.key, args.path)))
        return
    if args.cmd == "_write":
        res = phase_write(args.key, args.path)
    elif args.cmd == "_convert":
        res = phase_convert(args.ckpt, args.out)
    elif args.cmd == "_load":
        res = phase_load(args.out)
    elif args.cmd == "_generate":
        res = phase_generate(args.out, args.key, args.prompts, args.steps)
    else:
        res = phase_vlm(args.out, args.key, args.pairs)
    print(json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    main()
