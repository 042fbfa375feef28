"""LoRA learning curve of `mlx_dllm lora` on the embedded default: a new task, two-digit subtraction.

    python benchmarks/bench_lora.py [--iters 600] [--batch-size 32] [--learning-rate 2e-3]
                                    [--num-layers 4] [--every 50] [--problems 64]

The default model adds two-digit numbers; it has never seen "What is 83-27?". A completions jsonl of
subtraction problems (difference >= 10, so every answer has two digits) trains LoRA adapters
through the CLI's own path (lora.parse_args, mlx-lm's datasets and trainer, the masked-diffusion SFT
loss); every `--every` steps the held-out accuracy (exact answer, greedy, the CLI's chat prompt) and
the wall-clock and CPU time so far are printed. The machine may be shared: CPU seconds are the
steadier measure.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

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


def main():
    from mlx_lm.tuner.callbacks import TrainingCallback

    from mlx_dllm_models import batch_generate_diffusion, lora
    from mlx_dllm_models.default import chat_prompt, default_checkpoint
    from mlx_dllm_models.loader import load

    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--problems", type=int, default=64)
    a = p.parse_args()

    rows = subtraction(2000 + a.problems, seed=0)
    train, held_out = rows[: -a.problems], rows[-a.problems :]
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    (work / "data").mkdir()
    for name, part in (("train", train), ("valid", held_out[:8])):
        (work / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    lora_parameters = {"rank": a.rank, "dropout": 0.0, "scale": 20.0}
    args = lora.parse_args(
        ["--train", "--data", str(work / "data"), "--adapter-path", str(work / "adapters")]
        + ["--iters", str(a.iters), "--batch-size", str(a.batch_size)]
        + ["--learning-rate", str(a.learning_rate), "--num-layers", str(a.num_layers)]
        + ["--steps-per-eval", str(a.every), "--val-batches", "1", "--steps-per-report", "25"]
    )
    args.lora_parameters = lora_parameters
    args.model = default_checkpoint()
    model, tokenizer = load(args.model)
    prompts = [chat_prompt(tokenizer, r["prompt"]) for r in held_out]
    start, cpu = time.perf_counter(), time.process_time()

    def accuracy():
        out = batch_generate_diffusion(model, tokenizer, prompts, max_tokens=8, seed=0)
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

    train_set, valid_set, _ = lora._load_datasets(args, tokenizer)
    lora.train_model(args, model, train_set, valid_set, Report())


if __name__ == "__main__":
    main()
