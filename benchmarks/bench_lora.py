"""LoRA learning curve of `mlx_dllm lora` on the embedded default, on a task it cannot do.

    python benchmarks/bench_lora.py [--task german] [--iters 60] [--batch-size 16]
                                    [--learning-rate 1.5e-4] [--num-layers 4] [--every 20]
                                    [--problems 32] [--seed 0] [--max-seq-length 48]
                                    [--mask-eps 1e-3] [--low-discrepancy] [--cosine --warmup N]
                                    [--train-problems 400] [--rank 8] [--scale 20]

The default model adds two-digit numbers asked as "What is 47+85?". `--task german` asks the same
in German, "Was ist 47+85?" (held-out accuracy 0 before training: it answers nothing);
`--task subtraction` asks "What is 83-27?" (difference >= 10). A completions jsonl of 400 (german)
or 2000 (subtraction) problems, none of them held out, trains LoRA adapters through the CLI's own
path (lora.parse_args, mlx-lm's datasets and trainer, the masked-diffusion SFT loss); every
`--every` steps the accuracy on the held-out problems (exact answer, the checkpoint's decoding
defaults, the CLI's chat prompt) and the wall-clock and CPU time so far are printed. The machine
may be shared: CPU seconds are the steadier measure. tests/test_lora_learns.py's recipes:
`--seed 1 --mask-eps 0.3 --low-discrepancy` (the suite's), and with MLX_DLLM_SLOW_TESTS=1
`--seed 1 --batch-size 32 --iters 150 --learning-rate 2e-4 --cosine --warmup 5 --mask-eps 0.3
--low-discrepancy --train-problems 2000`. Without --low-discrepancy the noise levels are drawn
independently (`mlx_dllm lora --no-low-discrepancy`).
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def subtraction(n, seed):
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a - b >= 10 and (a, b) not in seen:
            seen.add((a, b))
            rows.append({"prompt": f"What is {a}-{b}?", "completion": str(a - b)})
    return rows


def german(n, problems, seed):
    """n training rows from the default's task range (never a held-out pair), then the first
    `problems` held-out pairs, both asked in German."""
    from mlx_dllm_models.default import held_out_list, held_out_pairs, in_addition_task

    rng, excluded, pairs = random.Random(seed), held_out_pairs(), {}
    while len(pairs) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if in_addition_task(a, b) and (a, b) not in excluded:
            pairs[(a, b)] = None
    pairs = list(pairs) + held_out_list()[:problems]
    return [{"prompt": f"Was ist {a}+{b}?", "completion": str(a + b)} for a, b in pairs]


def main():
    from mlx_lm.tuner.callbacks import TrainingCallback

    from mlx_dllm_models import batch_generate_diffusion, lora
    from mlx_dllm_models.default import chat_prompt, default_checkpoint
    from mlx_dllm_models.loader import load

    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=("german", "subtraction"), default="german")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1.5e-4)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-length", type=int, default=48)
    p.add_argument("--mask-eps", type=float, default=1e-3)
    p.add_argument("--low-discrepancy", action="store_true")
    p.add_argument("--scale", type=float, default=20.0)
    p.add_argument("--train-problems", type=int, default=400, help="german: training rows")
    p.add_argument("--warmup", type=int, default=0, help="with --cosine: linear warm-up steps")
    p.add_argument("--cosine", action="store_true", help="cosine decay to 5%% over --iters")
    a = p.parse_args()

    if a.task == "german":
        rows = german(a.train_problems, a.problems, seed=0)
    else:
        rows = subtraction(2000 + a.problems, seed=0)
    train, held_out = rows[: -a.problems], rows[-a.problems :]
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    (work / "data").mkdir()
    for name, part in (("train", train), ("valid", held_out[: a.batch_size])):
        (work / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    lora_parameters = {"rank": a.rank, "dropout": 0.0, "scale": a.scale}
    args = lora.parse_args(
        ["--train", "--data", str(work / "data"), "--adapter-path", str(work / "adapters")]
        + ["--iters", str(a.iters), "--batch-size", str(a.batch_size)]
        + ["--learning-rate", str(a.learning_rate), "--num-layers", str(a.num_layers)]
        + ["--steps-per-eval", str(a.every), "--val-batches", "1", "--steps-per-report", "25"]
        + ["--seed", str(a.seed), "--max-seq-length", str(a.max_seq_length)]
        + ["--mask-eps", str(a.mask_eps)]
        + (["--low-discrepancy"] if a.low_discrepancy else ["--no-low-discrepancy"])
    )
    args.lora_parameters = lora_parameters
    if a.cosine:
        lr = a.learning_rate
        args.lr_schedule = {
            "name": "cosine_decay",
            "arguments": [lr, a.iters - a.warmup, lr * 0.05],
            "warmup": a.warmup,
        }
    args.model = default_checkpoint()
    model, tokenizer = load(args.model)
    prompts = [chat_prompt(tokenizer, r["prompt"]) for r in held_out]
    start, cpu = time.perf_counter(), time.process_time()

    def accuracy():
        out = batch_generate_diffusion(model, tokenizer, prompts, seed=0)
        hits = sum(t.strip() == r["completion"] for t, r in zip(out.texts, held_out))
        return hits / len(held_out)

    class Report(TrainingCallback):
        def on_val_loss_report(self, info):
            acc = accuracy()
            print(
                f"step {info['iteration']:5d}  val loss {info['val_loss']:.3f}  held-out accuracy "
                f"{acc:.3f}  wall {time.perf_counter() - start:7.1f}s  cpu "
                f"{time.process_time() - cpu:7.1f}s",
                flush=True,
            )
            model.train()

    train_set, valid_set, _ = lora.load_datasets(args, tokenizer)
    np.random.seed(a.seed)  # mlx-lm's batch order, as lora.run seeds it
    lora.train_model(args, model, train_set, valid_set, Report(), lora.turn_closer(tokenizer))


if __name__ == "__main__":
    main()
