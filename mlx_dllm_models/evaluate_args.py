"""`mlx_dllm evaluate`'s flags (mlx_lm.evaluate's, and the likelihood estimator's), apart from
evaluate.py so that `mlx_dllm evaluate --help` and its flag errors need no lm-eval installed."""

import argparse
import json

from .cli_common import Parser

INSTALL = (
    "needs lm-evaluation-harness: python -m pip install 'mlx-dllm-models[eval]' (or "
    "`pip install lm-eval`)"
)


def build_parser():
    """mlx_lm.evaluate's flags, and the likelihood estimator's."""
    p = Parser(
        prog="mlx_dllm evaluate",
        description="Evaluate a diffusion language model with lm-evaluation-harness: "
        "loglikelihood from the masked-diffusion ELBO, generate_until from diffusion decoding. "
        f"It {INSTALL}.",
    )
    p.add_argument("--model", default=None, help="checkpoint folder or Hugging Face repo id")
    p.add_argument("--adapter-path", default=None, help="LoRA adapters (mlx_dllm lora's output)")
    p.add_argument("--tasks", nargs="+", required=True)
    p.add_argument("--include-path", default=None, help="a folder of your own lm-eval task YAMLs")
    p.add_argument("--output-dir", default=".", help="Output directory for result files.")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="rows per forward: Monte-Carlo samples when scoring, prompts when generating",
    )
    p.add_argument("--num-shots", type=int, default=None, help="Number of shots")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens (over task defaults)")
    p.add_argument("--limit", type=int, default=None, help="Limit the number of examples per task.")
    p.add_argument("--seed", type=int, default=123, help="Random seed.")
    p.add_argument("--fewshot-as-multiturn", action="store_true", default=False)
    p.add_argument("--apply-chat-template", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--chat-template-args", type=json.loads, default="{}")
    p.add_argument("--confirm-run-unsafe-code", action="store_true", default=False)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature when generating")
    p.add_argument(
        "--mc-samples",
        type=int,
        default=128,
        help="Monte-Carlo samples of the likelihood estimate (LLaDA's default 128)",
    )
    p.add_argument("--cfg-scale", type=float, default=0.0, help="LLaDA's guidance when scoring")
    return p
