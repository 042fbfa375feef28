"""The embedded default checkpoint of the CLI, and the task it was trained on.

A small LLaDA model (LLaDAModelLM layout, byte-level tokenizer, LLaDA chat template) shipped inside
the package under assets/default, trained by examples/train_default.py with
mlx_dllm_models.training on a task whose answers can be checked: adding two two-digit numbers whose
sum has three digits ("What is 47+85?" -> "132"). When the
asset is missing (a trimmed install), a tiny random LLaDA checkpoint is built offline into the user
cache instead; it proves the plumbing only.

Kept free of heavy imports: the CLI imports it at start-up.
"""

import os
import random
from pathlib import Path
from typing import List, Optional, Tuple

from .prompts import render_chat, user_turn

DEFAULT_PROMPT = "What is 47+85?"

# The trained default model, inside the package.
ASSET = Path(__file__).parent / "assets" / "default"

OPERANDS = (10, 99)


def default_checkpoint() -> str:
    if (ASSET / "config.json").exists():
        return str(ASSET)
    from .tiny import build_tiny_llada

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_dllm_models"
    path = root / "tiny-llada-v1"
    if not (path / "config.json").exists() or not (path / "tokenizer_config.json").exists():
        build_tiny_llada(path)
    return str(path)


def model_or_default(model: Optional[str]) -> str:
    """A command's --model: the checkpoint given, or the embedded default when none is (None)."""
    return default_checkpoint() if model is None else model


# ------------------------------------------------------------------------------------- the task


def addition_prompt(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def in_addition_task(a: int, b: int) -> bool:
    # A three-digit sum puts every digit of the answer at a fixed canvas position.
    lo, hi = OPERANDS
    return lo <= a <= hi and lo <= b <= hi and a + b >= 100


def held_out_problems(n: int = 200) -> List[Tuple[str, str]]:
    """A fixed list of (user message, answer) that training never sees, DEFAULT_PROMPT first; the
    first n of the same list for any n <= 250."""
    if not 0 < n <= 250:
        raise ValueError(f"n must be in 1..250, got {n}")
    return [(addition_prompt(a, b), str(a + b)) for a, b in held_out_list()[:n]]


def held_out_list():
    """The 250 held-out (a, b), in order: DEFAULT_PROMPT's first."""
    rng = random.Random(20240607)
    pairs = [(47, 85)]
    seen = {(47, 85), (85, 47)}
    while len(pairs) < 250:
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        # Both orders are held out: commutativity is not a free answer.
        if in_addition_task(a, b) and (a, b) not in seen:
            pairs.append((a, b))
            seen.update({(a, b), (b, a)})
    return pairs


def held_out_pairs():
    """What training must exclude: the held-out (a, b), in both orders."""
    return {p for a, b in held_out_list() for p in ((a, b), (b, a))}


# The long-context form of the task: solved examples before the question. With 7 shots
# the templated prompt is about 256 tokens, with 15 about 475 (the default model has 512 positions).
FEW_SHOT_INSTRUCTION = "Solve the last problem. Solved examples:"


def few_shot_message(question: str, shots: int, seed: int = 0) -> str:
    """`question` after `shots` solved examples drawn (seeded) from the training problems, never
    from the held-out set, so a held-out question keeps its answer out of the prompt."""
    rng = random.Random(seed)
    held = held_out_pairs()
    lines = [FEW_SHOT_INSTRUCTION]
    while len(lines) <= shots:
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        if in_addition_task(a, b) and (a, b) not in held:
            lines.append(f"Q: {addition_prompt(a, b)}\nA: {a + b}\n")
    return "\n".join(lines + [f"Q: {question}"]) if shots else question


def is_correct(answer: str, expected: str) -> bool:
    return answer.strip() == expected


def chat_prompt(tokenizer, message: str) -> str:
    """`message` as `mlx_dllm generate` sends it: one user turn through the chat template."""
    return render_chat(tokenizer, user_turn(message))
