"""Train the package's embedded default model: a small LLaDA that adds two-digit numbers.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python examples/train_default.py                 # writes mlx_dllm_models/assets/default/

Everything is made offline and seeded: the byte-level tokenizer with LLaDA's special tokens and
chat template (mlx_dllm_models.tiny), the data ("What is 47+85?" -> "132": two-digit operands with a
three-digit sum, minus the held-out set of mlx_dllm_models.default), the initial weights and the
noise draws.
The model is LLaDA 8B's architecture at toy size (LLaDAModelLM config and OLMo key names), trained
with LLaDA's SFT loss (mlx_dllm_models.training: the prompt is never masked, the answer is padded
with EOS up to the canvas, which is how a fixed canvas yields variable-length answers). Canvases of
16 to 128 positions are mixed; the checkpoint's generation_config.json sets the CLI's defaults to
16 new tokens in blocks of 8, where it is most accurate.

What made it train in minutes at this size (each measured on this task, the alternative leaving
accuracy near zero after 1000+ steps):
* rope_theta=100 instead of LLaDA's 500000 (or 10000): a masked position inside a long run of masks
  (the EOS-padded canvas) only knows which answer digit it is from its RoPE distance to the prompt,
  and with few fast-rotating frequencies a small model did not learn that in time;
* batches of 64 rows: at 16-32 rows the loss's per-row noise stalled training;
* eps=0.3, i.e. t ~ U(0.3, 1): with LLaDA's eps=1e-3 the 1/t weight of the few lightly masked rows
  dominated each batch's gradient;
* a learning rate of 1e-3 (2e-3 and up diverged).
Even so, learning goes through a sharp transition whose timing depends on the schedule: the
committed run was at 2% held-out accuracy at step 1200 and 80% at step 1800, while the same recipe
stretched to 3000 steps (a slower cosine) was still near 10% at step 2400. Change STEPS with care.

About 15-20 minutes on 2 CPU cores. On Linux, mlx's bundled BLAS is slow for float32 matmuls;
preloading the system's OpenBLAS (the LD_PRELOAD above, package libopenblas0-pthread) made a
training step about 30x faster here. Results are reproducible per machine: thread counts and BLAS
change float summation order, so weights are not bit-identical across setups.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx_dllm_models_hook  # noqa: E402,F401
from mlx_dllm_models import batch_generate_diffusion  # noqa: E402
from mlx_dllm_models.default import (  # noqa: E402
    DEFAULT_PROMPT,
    OPERANDS,
    addition_prompt,
    chat_prompt,
    few_shot_message,
    held_out_pairs,
    held_out_problems,
    in_addition_task,
    is_correct,
)
from mlx_dllm_models.models.llada import Model, ModelArgs  # noqa: E402
from mlx_dllm_models.tiny import (  # noqa: E402
    LLADA_SPECIAL_TOKENS,
    build_llada_tokenizer,
    llada_config,
)
from mlx_dllm_models.training import save_checkpoint, train  # noqa: E402

OUT = ROOT / "mlx_dllm_models" / "assets" / "default"

SEED = 0
STEPS = 2000  # the committed weights: 2000 steps, 720 s here
LEARNING_RATE = 1e-3
WARMUP = 100
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
EPS = 0.3
ROWS = 64
ROWS_LONG = 32  # rows of a batch whose canvas is 128 (the cost of a step stays near the others')
# Canvas (answer + EOS padding) lengths and how often each is drawn; 128 is the CLI's max_tokens.
CANVASES = (16, 32, 128)
CANVAS_WEIGHTS = (0.8, 0.1, 0.1)

BOS, EOS = LLADA_SPECIAL_TOKENS["<|startoftext|>"], LLADA_SPECIAL_TOKENS["<|endoftext|>"]
MASK = LLADA_SPECIAL_TOKENS["<|mdm_mask|>"]
VOCAB = 264

CONFIG = llada_config(
    d_model=128,
    n_layers=4,
    n_heads=4,
    mlp_hidden_size=384,
    vocab_size=VOCAB,
    special_tokens=LLADA_SPECIAL_TOKENS,
    max_sequence_length=512,
)
# See the docstring: fast-rotating RoPE frequencies are what let this small model learn in time.
CONFIG.update(mlp_ratio=3, rope_theta=100.0)
CONFIG.pop("torch_dtype")
# Decoding defaults the CLI reads: answers are at most 4 tokens; blocks of 8 measured best
# (0.983 held-out accuracy with quota and with threshold 0.9, against 0.78 / 0.88 with blocks of 16).
GENERATION_CONFIG = {
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": EOS,
    "max_new_tokens": 16,
    "block_length": 8,
}

# Phase 2 (issue #14, opt-in with --few-shot-steps N): the same task after a long few-shot context
# (few_shot_message: solved examples before the question, about 28 tokens each), so that what an
# approximate cache costs on a long prompt can be measured. It continues from phase 1's weights
# (--from-checkpoint skips phase 1; --few-shot-from-start mixes the same batches into phase 1
# instead). Each batch draws a shot count k in 0..--train-shots: k = 0 is a phase-1 batch (so the
# single-question skill is kept), k > 0 a batch of rows of one length (no compute spent on
# padding) holding about --few-shot-tokens positions, whose solved examples' answers are trained
# on too (Data); --single-share P draws a single-question batch with probability P instead, else
# k in 1..--train-shots. --jitter puts 0..N random characters before the single questions.
# Not part of the committed weights: no run converged. Held-out accuracy on 50 problems (0 / 7 / 15
# solved examples; OpenBLAS, 1 thread a run, two runs sharing the 2 cores):
#   * from the committed weights, the final answer only trained (8192 positions a few-shot batch):
#     k in 1..16 half the batches, 2e-4, 300 steps: single questions 0.98 -> 0.58 (step 100) ->
#     0.80; 4 or 16 examples 0.02-0.04. k in 0..16, 5e-4, 100 steps: single 0.00. k in 0..4, 3e-4,
#     350 steps: single 0.14 / 0.08 / 0.48 at steps 100 / 200 / 300, few-shot at most 0.08;
#   * from the committed weights, examples' answers trained too, k in 1..15, a few-shot batch 65%
#     of the time: all weights at 3e-4, 600 steps: single 0.82 -> 0.02 (step 100) -> 0.72, few-shot
#     0.00-0.06 throughout; only the attention's q/k projections at 5e-4: single 0.82 -> 0.34 / 0.38
#     at steps 100 / 200, few-shot 0.00-0.04 (stopped);
#   * from scratch (--few-shot-from-start --single-share 0.35 --train-shots 16 --few-shot-tokens
#     2560), the committed recipe's 1e-3 and 2000-step schedule, stopped at step 1550 (2-3.3 s a
#     step, 85 minutes): 0.08 / 0.00 / 0.04 at step 250, then at most 0.04 up to step 1500; with
#     k in 1..8 (share 0.3, 2048 positions, 1600-step schedule), stopped at step 1100: 0.00-0.06;
#     with k in 1..15, --jitter 32, share 0.6, 2048 positions, stopped at step 1200: 0.00-0.02;
#     with --jitter 48, share 0.85 (another seed), stopped at step 450: 0.00;
#   * from scratch with many short few-shot rows (--shot-skew: k drawn in proportion to k**-S, so
#     most few-shot batches hold 30-40 rows of 1-2 examples instead of 5-8 long ones), share 0.4 or
#     0.5, k in 1..15, 3072-4096 positions, 0 / 1 / 7 / 15 solved examples: S=2, a 1600-step
#     schedule (1.9 s a step): at most 0.06 at steps 250-1500 (loss 0.39 at step 1500, cosine
#     nearly done; stopped); S=1.5, 2400 steps (2.5-3.6 s a step): at most 0.06 up to step 2000
#     (learning rate down to 1.2e-4; stopped); S=0.75 ran at 3.9 s a step, stopped at step 250.
#   The committed phase 1 itself went from 0.02 at step 1200 to 0.80 at step 1800, so these runs
#   may be too short; with few-shot rows each step costs 3-6x a phase-1 step here, so one attempt
#   at the committed schedule's length takes 1.5-2.5 hours on this machine's 2 cores.
# Why the committed model cannot be extended: it learnt one layout, not the task's structure. Every
# training prompt has the same length ("What is ab+cd?" is always 14 characters), so a position's
# offset from the start of the prompt says which digit sits where, and the model reads the
# question that way: one space before or after the question takes it from 1.00 to 0.02-0.04 (50
# problems), as does any prefix (28 characters of "lorem ipsum": 0.04). Answering after solved
# examples means addressing the question relative to the answer, which the model must learn anew;
# fine-tuning unlearns the single-question skill first. Long rows are also slow to train here: a
# batch of 32 rows of 227-513 positions took 4x a phase-1 batch (12.7 s against 3.0 s, 3 jobs on 2
# cores), much of it attention's softmax (mlx's CPU exp: benchmarks/bench_cpu_ops.py).
FEW_SHOT_STEPS = 0  # see above: set with --few-shot-steps
FEW_SHOT_LEARNING_RATE = 3e-4
FEW_SHOT_WARMUP = 50
FEW_SHOT_TOKENS = 2560  # positions of a few-shot batch: 64 rows (ROWS) of 1 shot, 5 of 16
MAX_SHOTS = 16
TRAIN_SHOTS = 4  # shot counts drawn for training: 0..TRAIN_SHOTS
ANSWER_CUE = list(b"A: ")  # a solved example's answer follows it (the byte-level tokenizer)
FILLER = "abcdefghij klmnopqrstuvwxyz.,"  # --jitter's characters before a single question

# Decoding used to monitor training: the CLI's sampler (quota, one token per step) on a short canvas.
MONITOR = dict(max_tokens=16, block_length=16, steps=16)


class Data:
    """Seeded stream of SFT batches. A row is the templated question, the answer, then EOS up to the
    batch's canvas length, as LLaDA's SFT pads. Single-question batches are (tokens (B, L), prompt
    lengths (B,)); few-shot batches (max_shots > 0) are {"tokens", "maskable"}: the solved
    examples' answers inside the prompt are noised and scored too (training.diffusion_loss's
    `maskable`), so a row of k examples trains k + 1 answers, each at another offset."""

    def __init__(
        self,
        tokenizer,
        seed,
        max_shots=0,
        jitter=0,
        few_shot_tokens=None,
        single_share=None,
        shot_skew=0.0,
    ):
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer
        self.held_out = held_out_pairs()
        self.max_shots = max_shots  # each batch: 0..max_shots solved examples before the question
        self.jitter = jitter  # single questions: 0..jitter filler characters before the question
        self.few_shot_tokens = few_shot_tokens or FEW_SHOT_TOKENS  # positions of a few-shot batch
        # None: k uniform in 0..max_shots; else a single-question batch with this probability,
        # otherwise k uniform in 1..max_shots.
        self.single_share = single_share
        # k > 0 drawn with probability proportional to k**-shot_skew (0: uniform): short rows hold
        # more rows a batch, and the row count is what keeps the loss's noise down.
        self.shot_p = None
        if shot_skew:
            weights = np.arange(1, max_shots + 1, dtype=np.float64) ** -shot_skew
            self.shot_p = weights / weights.sum()
        self.count = 0

    def problem(self):
        while True:
            a, b = (int(x) for x in self.rng.integers(OPERANDS[0], OPERANDS[1] + 1, size=2))
            if in_addition_task(a, b) and (a, b) not in self.held_out:
                return addition_prompt(a, b), str(a + b)

    def encode(self, message):
        return self.tokenizer.encode(chat_prompt(self.tokenizer, message), add_special_tokens=False)

    def filler(self):
        # Without jitter, no draw: phase 1's data stream stays the committed weights'.
        if not self.jitter:
            return ""
        n = int(self.rng.integers(0, self.jitter + 1))
        return "".join(self.rng.choice(list(FILLER), size=n))

    def batch(self):
        self.count += 1
        rows = []
        # No draw without few-shot batches: phase 1's data stream stays the committed weights'.
        if not self.max_shots:
            shots = 0
        elif self.single_share is None:
            shots = int(self.rng.integers(0, self.max_shots + 1))
        else:
            single = self.rng.random() < self.single_share
            if single:
                shots = 0
            elif self.shot_p is None:
                shots = int(self.rng.integers(1, self.max_shots + 1))
            else:
                shots = 1 + int(self.rng.choice(self.max_shots, p=self.shot_p))
        if shots:
            canvas = MONITOR["max_tokens"]
            while not rows or len(rows) * (len(rows[0][0]) + canvas) < self.few_shot_tokens:
                message, answer = self.problem()
                seed = int(self.rng.integers(2**31))
                rows.append(
                    (self.encode(few_shot_message(message, shots, seed)), list(answer.encode()))
                )
                if len(rows) == ROWS:
                    break
        else:
            canvas = int(self.rng.choice(CANVASES, p=CANVAS_WEIGHTS))
            for _ in range(ROWS_LONG if canvas > 64 else ROWS):
                message, answer = self.problem()
                rows.append((self.encode(self.filler() + message), list(answer.encode())))
        width = max(len(p) for p, _ in rows) + canvas
        tokens = np.full((len(rows), width), EOS, np.int32)
        for i, (prompt, ans) in enumerate(rows):
            tokens[i, : len(prompt)] = prompt
            tokens[i, len(prompt) : len(prompt) + len(ans)] = ans
        lengths = np.array([len(p) for p, _ in rows], np.int32)
        if not shots:
            return tokens, lengths
        maskable = np.arange(width)[None] >= lengths[:, None]
        for i, (prompt, _) in enumerate(rows):
            for j in range(len(prompt) - len(ANSWER_CUE)):  # the 3 digits after each "A: "
                if prompt[j : j + len(ANSWER_CUE)] == ANSWER_CUE:
                    maskable[i, j + len(ANSWER_CUE) : j + len(ANSWER_CUE) + 3] = True
        return {"tokens": tokens, "maskable": maskable}

    def __iter__(self):
        while True:
            yield self.batch()


def accuracy(model, tokenizer, problems, **settings):
    prompts = [chat_prompt(tokenizer, m) for m, _ in problems]
    out = batch_generate_diffusion(model, tokenizer, prompts, **settings)
    return float(np.mean([is_correct(t, a) for t, (_, a) in zip(out.texts, problems)]))


def run_phase(model, data, steps, learning_rate, warmup, seed, monitor_every, monitor):
    """`steps` optimiser steps of the SFT loss over `data`, AdamW with a linear warm-up then a
    cosine decay to 5%; `monitor()` runs every `monitor_every` steps."""
    warmup = min(warmup, steps // 2)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(0.0, learning_rate, warmup),
            optim.cosine_decay(learning_rate, steps - warmup, learning_rate * 0.05),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=WEIGHT_DECAY)
    tic = time.time()
    window = []

    def batches():
        it = iter(data)
        for _ in range(steps):
            yield next(it)

    def callback(step, loss):
        window.append(loss)
        if (step + 1) % 50 == 0:
            print(
                f"step {step + 1} loss {np.mean(window):.4f} lr {optimizer.learning_rate.item():.2e} "
                f"{time.time() - tic:.0f}s",
                flush=True,
            )
            window.clear()
        if monitor_every and (step + 1) % monitor_every == 0:
            monitor(step + 1)

    losses = train(
        model,
        batches(),
        optimizer=optimizer,
        seed=seed,
        eps=EPS,
        low_discrepancy=True,
        max_grad_norm=MAX_GRAD_NORM,
        callback=callback,
    )
    print(
        f"trained {len(losses)} steps in {time.time() - tic:.0f}s, last loss {np.mean(losses[-50:]):.4f}",
        flush=True,
    )


def parse_args():
    """The command line, with the combinations that would silently do nothing refused."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--few-shot-steps", type=int, default=FEW_SHOT_STEPS)
    p.add_argument(
        "--from-checkpoint",
        type=Path,
        help="skip phase 1 and continue from this checkpoint's weights (phase 1's output)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--train-shots", type=int, default=TRAIN_SHOTS)
    p.add_argument(
        "--few-shot-from-start",
        action="store_true",
        help="phase 1 draws few-shot batches too (0..--train-shots solved examples)",
    )
    p.add_argument("--few-shot-lr", type=float, default=FEW_SHOT_LEARNING_RATE)
    p.add_argument("--few-shot-tokens", type=int, default=FEW_SHOT_TOKENS)
    p.add_argument(
        "--single-share",
        type=float,
        help="share of single-question batches (default: k uniform in 0..--train-shots)",
    )
    p.add_argument(
        "--shot-skew",
        type=float,
        default=0.0,
        help="with --single-share: k drawn with probability proportional to k**-S (0: uniform)",
    )
    p.add_argument(
        "--jitter",
        type=int,
        default=0,
        help="single questions get 0..N random filler characters before them (0: phase 1's data)",
    )
    p.add_argument(
        "--monitor-shots", default="0", help="shot counts the monitor reports, e.g. 0,4,15"
    )
    p.add_argument("--monitor-every", type=int, default=300)
    args = p.parse_args()
    if args.shot_skew and args.single_share is None:
        p.error("--shot-skew applies to the few-shot counts drawn with --single-share: give both")
    # Options that only shape few-shot batches: refused rather than ignored without them.
    few_shot_only = {
        "--train-shots": args.train_shots != TRAIN_SHOTS,
        "--few-shot-tokens": args.few_shot_tokens != FEW_SHOT_TOKENS,
        "--single-share": args.single_share is not None,
        "--shot-skew": bool(args.shot_skew),
    }
    unused = [name for name, given in few_shot_only.items() if given]
    if unused and not (args.few_shot_steps or args.few_shot_from_start):
        p.error(
            f"{', '.join(unused)} shape few-shot batches: add --few-shot-steps N or --few-shot-from-start"
        )
    if args.few_shot_lr != FEW_SHOT_LEARNING_RATE and not args.few_shot_steps:
        p.error("--few-shot-lr is phase 2's learning rate: add --few-shot-steps N")
    return args


def build_model(from_checkpoint):
    """A fresh model drawn from mx.random's current state, or phase 1's weights when
    `from_checkpoint` is given."""
    model = Model(ModelArgs.from_dict(CONFIG))
    if from_checkpoint:
        weights = mx.load(str(from_checkpoint / "model.safetensors"))
        model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{n_params / 1e6:.2f}M parameters", flush=True)
    return model


def final_report(model, wrapped, monitor_shots):
    """Held-out accuracy on the benchmark's 200 problems per shot count, then one generation with
    the CLI's defaults."""
    for k in monitor_shots:
        problems = [
            (few_shot_message(m, k, i), a) for i, (m, a) in enumerate(held_out_problems(200))
        ]
        acc = accuracy(model, wrapped, problems, **MONITOR)
        print(f"held-out accuracy (200 problems, {k} shots, {MONITOR}): {acc:.3f}")
    # The CLI's defaults (128 new tokens in blocks of 32, one token per step).
    text = batch_generate_diffusion(model, wrapped, [chat_prompt(wrapped, DEFAULT_PROMPT)]).texts[0]
    print(f"{DEFAULT_PROMPT!r} with the CLI's defaults -> {text!r}")


def main():
    args = parse_args()
    if args.few_shot_steps or args.few_shot_from_start:
        CONFIG["max_sequence_length"] = 1024  # few-shot prompts of up to ~500 tokens + canvases
    mx.random.seed(SEED)
    tmp = Path(tempfile.mkdtemp())
    tokenizer = build_llada_tokenizer(tmp)
    model = build_model(args.from_checkpoint)

    # What load() would return: mlx-lm's tokenizer wrapper, the generation config on the model.
    wrapped = TokenizerWrapper(tokenizer)
    model.generation_config = dict(GENERATION_CONFIG)
    monitor = held_out_problems(250)[200:]  # not the benchmark's 200

    def report(step, shots=(0,)):
        for k in shots:
            problems = [(few_shot_message(m, k, i), a) for i, (m, a) in enumerate(monitor)]
            acc = accuracy(model, wrapped, problems, **MONITOR)
            print(
                f"step {step} accuracy on {len(monitor)} held-out problems, {k} shots: {acc:.3f}",
                flush=True,
            )

    monitor_shots = [int(k) for k in args.monitor_shots.split(",")]

    def data(seed, max_shots):
        return Data(
            tokenizer,
            seed,
            max_shots,
            args.jitter,
            args.few_shot_tokens,
            args.single_share,
            args.shot_skew,
        )

    if not args.from_checkpoint:
        run_phase(
            model,
            data(SEED, args.train_shots if args.few_shot_from_start else 0),
            args.steps,
            LEARNING_RATE,
            WARMUP,
            SEED,
            args.monitor_every,
            lambda step: report(step, monitor_shots),
        )
    if args.few_shot_steps:
        run_phase(
            model,
            data(SEED + 1, args.train_shots),
            args.few_shot_steps,
            args.few_shot_lr,
            FEW_SHOT_WARMUP,
            SEED + 1,
            args.monitor_every // 3,
            lambda step: report(step, monitor_shots),
        )

    if args.out.exists():
        shutil.rmtree(args.out)
    save_checkpoint(
        args.out,
        model,
        CONFIG,
        tokenizer=tokenizer,
        generation_config=GENERATION_CONFIG,
        dtype=mx.float32,
    )
    shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)")
    final_report(model, wrapped, monitor_shots)


if __name__ == "__main__":
    main()
