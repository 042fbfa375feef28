"""`mlx_dllm lora` teaches the embedded default a task it cannot do (issue 15 §3).

The default adds two-digit numbers asked as "What is 47+85?". Asked in German, "Was ist 47+85?"
(the digits at the same positions), it answers nothing: held-out accuracy 0. A completions jsonl
of German questions trains LoRA adapters through the real CLI, in a fresh process (mlx-lm's data,
trainer, YAML config and adapter files, the masked-diffusion SFT loss); the adapters, loaded back
with `load(path, adapter_path=...)` and by `mlx_dllm generate --adapter-path`, answer the held-out
questions: at least 0.8 of them with MLX_DLLM_SLOW_TESTS=1 (the issue's bar), at least 0.3 in the
suite's budget (below). BENCHMARKS.md ("LoRA on the embedded default") has the learning curves
behind both recipes.
"""

import json
import os
import random

import pytest

from helpers import run_cli
from mlx_dllm_models.default import (
    chat_prompt,
    default_checkpoint,
    held_out_pairs,
    held_out_problems,
    in_addition_task,
)

HELD_OUT = 32
# MLX_DLLM_SLOW_TESTS=1 runs the recipe that reaches the 0.8 from every seed measured
# (BENCHMARKS.md): 150 steps of 32 rows at 2e-4 on a cosine schedule from mlx-lm's YAML config.
# It takes about 8 minutes on 2 CPU cores with mlx's bundled BLAS (2 with OpenBLAS), which the
# suite's budget in CI cannot hold; there, 60 steps of 16 rows at a constant 1.5e-4 (a fifth of
# the compute, about 85 s) must show the learning: from 0 to at least 0.3.
SLOW = os.environ.get("MLX_DLLM_SLOW_TESTS") == "1"
ITERS, BATCH, LEARNING_RATE, FLOOR = (150, 32, 2e-4, 0.8) if SLOW else (60, 16, 1.5e-4, 0.3)
# German questions to train on (never a held-out pair); 60 steps of 16 learned more reliably from
# 400 (a few passes over each) than from 2000.
TRAIN_ROWS = 2000 if SLOW else 400
# Both use the loss's lower-variance settings: a mask-rate floor of 0.3 (the 1/p weight of a
# lightly masked row no longer dominates a batch) and noise levels spread over the batch. Learning
# rates of 3e-4 and up collapse some seeds to constant answers (mlx-lm's LoRA scale is 20); rank 8
# on every linear layer of the 4.
LORA_FLAGS = ["--iters", str(ITERS), "--batch-size", str(BATCH), "--num-layers", "4"]
LORA_FLAGS += ["--learning-rate", str(LEARNING_RATE), "--seed", "1"]
LORA_FLAGS += ["--mask-eps", "0.3", "--low-discrepancy"]
# mlx-lm pads rows to 1 + a multiple of 32 positions, capped here: the chat prompt is 37 tokens
# and the answer 4, so 48 positions (11 answer + EOS padding) hold every row and cost a quarter
# less than 65.
LORA_FLAGS += ["--max-seq-length", "48", "--steps-per-eval", "1000", "--val-batches", "1"]
SCHEDULE = {
    "name": "cosine_decay",
    "arguments": [LEARNING_RATE, ITERS - 5, LEARNING_RATE * 0.05],
    "warmup": 5,
}


def german(a, b):
    return f"Was ist {a}+{b}?", str(a + b)


def _held_out():
    return [german(*map(int, q[len("What is ") : -1].split("+"))) for q, _ in held_out_problems()]


def _answered(model, tokenizer, problems):
    """The problems the model answers right."""
    from mlx_dllm_models import batch_generate_diffusion

    prompts = [chat_prompt(tokenizer, q) for q, _ in problems]
    # The checkpoint's generation_config defaults, as `mlx_dllm generate` decodes.
    out = batch_generate_diffusion(model, tokenizer, prompts, seed=0)
    return [(q, a) for t, (q, a) in zip(out.texts, problems) if t.strip() == a]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_learns")
    data = root / "data"
    data.mkdir()
    rng, excluded, rows = random.Random(0), held_out_pairs(), {}
    while len(rows) < TRAIN_ROWS:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if in_addition_task(a, b) and (a, b) not in excluded:
            rows[(a, b)] = german(a, b)
    lines = [json.dumps({"prompt": q, "completion": ans}) + "\n" for q, ans in rows.values()]
    (data / "train.jsonl").write_text("".join(lines))
    (data / "valid.jsonl").write_text("".join(lines[:32]))  # one batch
    adapters = root / "adapters"
    config = root / "lora.yaml"
    # The slow recipe's schedule comes from a YAML config file, as mlx_lm.lora reads it.
    config.write_text(json.dumps({"lr_schedule": SCHEDULE} if SLOW else {}))  # JSON is YAML
    proc = run_cli(
        "lora",
        "-c",
        str(config),
        "--train",
        "--data",
        str(data),
        "--adapter-path",
        str(adapters),
        *LORA_FLAGS,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return adapters


@pytest.mark.slow
def test_the_default_cannot_do_the_task_before_training():
    from mlx_dllm_models.loader import load

    model, tokenizer = load(default_checkpoint())
    assert len(_answered(model, tokenizer, _held_out()[:HELD_OUT])) <= 0.1 * HELD_OUT


@pytest.fixture(scope="module")
def answered(trained):
    """The held-out problems the adapters, loaded back, answer right."""
    from mlx_dllm_models.loader import load

    model, tokenizer = load(default_checkpoint(), adapter_path=str(trained))
    answered = _answered(model, tokenizer, _held_out()[:HELD_OUT])
    print(f"held-out accuracy {len(answered)}/{HELD_OUT}")  # shown by pytest -s or -rP
    return answered


@pytest.mark.slow
def test_lora_adapters_learn_the_task_and_load_back(trained, answered):
    assert (trained / "adapters.safetensors").exists()
    assert json.loads((trained / "adapter_config.json").read_text())["fine_tune_type"] == "lora"
    assert len(answered) >= FLOOR * HELD_OUT, len(answered)


@pytest.mark.slow
def test_generate_answers_with_the_adapters(trained, answered):
    # A held-out problem the adapted model answers right in Python (one answer of a half-trained
    # model can fall either way): the CLI must load the same adapters and answer it the same.
    question, answer = answered[0]
    proc = run_cli(
        "generate", "--adapter-path", str(trained), "--prompt", question, "--verbose", "false"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == answer


def test_sft_rows_end_with_eos_not_the_templates_end_of_turn():
    """mlx-lm's completions rows end with the chat template's <|eot_id|>; LLaDA's SFT data puts EOS
    right after the answer. The loss must see the same tokens as if the row had been written that
    way, or the adapted model would write <|eot_id|> into every answer."""
    import mlx.core as mx

    from mlx_dllm_models.loader import load
    from mlx_dllm_models.lora import sft_loss, turn_closer

    model, tokenizer = load(default_checkpoint())
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert turn_closer(tokenizer) == [eot]
    spec = model.diffusion_spec
    messages = [{"role": "user", "content": "Was ist 47+85?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    row = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "132"}])
    assert row[-1] == eot and row[: len(prompt)] == prompt
    batch = mx.array([row + [0] * (48 - len(row))])
    # The user turn ends with <|eot_id|> too: only the answer's is replaced.
    as_llada_writes_it = mx.array([row[:-1] + [spec.eos_token_ids[0]] + [0] * (48 - len(row))])

    def loss(fn, tokens, length):
        mx.random.seed(3)  # the same noise draws for every call
        return fn(model, tokens, mx.array([[len(prompt), length]]))[0].item()

    closed = loss(sft_loss(spec, closer=[eot]), batch, len(row))
    assert closed == pytest.approx(loss(sft_loss(spec), as_llada_writes_it, len(row) - 1))
    assert closed != pytest.approx(loss(sft_loss(spec), batch, len(row)))
