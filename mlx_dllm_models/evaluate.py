"""`mlx_dllm evaluate`: lm-evaluation-harness on a diffusion model, with mlx_lm.evaluate's flags.

mlx_lm.evaluate's `MLXLM` scores a continuation by next-token log-probabilities and generates
autoregressively; neither means anything for a masked-diffusion model. `DiffusionLM` answers
lm-eval's three requests the way the diffusion references evaluate:

* `loglikelihood`: the Monte-Carlo ELBO of likelihood.log_likelihood (LLaDA's
  get_log_likelihood.py, Dream's eval.py), and likelihood.greedy_matches for the `is_greedy` flag
  (LLaDA eval_llada.py's suffix greedy check);
* `generate_until`: generate.batch_generate_diffusion, each answer cut at the task's stop strings;
* `loglikelihood_rolling` (perplexity tasks): no reference estimator; a clear error.

Needs the optional `[eval]` extra (lm-eval), as mlx-lm's evaluate does.
"""

import difflib
import json
import os
from importlib.metadata import version
from pathlib import Path

import lm_eval
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from .default import model_or_default
from .evaluate_args import build_parser
from .generate import batch_generate_diffusion
from .likelihood import check_counts, greedy_matches, log_likelihood
from .prompts import has_chat_template, render_chat
from .settings import SettingsError
from .vision import text_tokenizer

LM_EVAL_SEEDS = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")


def _cut_at(text: str, until) -> str:
    """The text before the first stop string (mlx_lm.evaluate's `_rstrip_until`)."""
    stops = [text.find(u) for u in until or () if u]
    stops = [i for i in stops if i >= 0]
    return text[: min(stops)] if stops else text


class DiffusionLM(LM):
    """An lm-eval model over a loaded diffusion model (`mlx_dllm_models.load`)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 8,
        max_tokens=None,
        use_chat_template=None,
        chat_template_args=None,
        mc_samples: int = 128,
        cfg_scale: float = 0.0,
        seed: int = 0,
        settings=None,
    ):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.text_tokenizer = text_tokenizer(tokenizer)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        if use_chat_template is None:
            use_chat_template = has_chat_template(tokenizer)
        self.use_chat_template = use_chat_template
        self.chat_template_args = dict(chat_template_args or {})
        self.mc_samples, self.cfg_scale, self.seed = mc_samples, cfg_scale, seed
        self.overrides = dict(settings or {})

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.text_tokenizer, "name_or_path", "tokenizer").replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        return render_chat(
            self.tokenizer, chat_history, self.chat_template_args, add_generation_prompt
        )

    def loglikelihood(self, requests) -> list:
        out = []
        for i, request in enumerate(requests):
            context, continuation = request.args
            ll = log_likelihood(
                self.model,
                self.tokenizer,
                context,
                continuation,
                mc_samples=self.mc_samples,
                batch_size=min(self.batch_size, self.mc_samples),
                cfg_scale=self.cfg_scale,
                seed=self.seed + i,
            )
            greedy = greedy_matches(
                self.model, self.tokenizer, context, continuation, cfg_scale=self.cfg_scale
            )
            out.append((float(ll), bool(greedy)))
        return out

    def loglikelihood_rolling(self, requests) -> list:
        raise SettingsError(
            "perplexity tasks (loglikelihood_rolling) have no diffusion reference estimator: "
            "choose multiple-choice (loglikelihood) or generate_until tasks"
        )

    def generate_until(self, requests) -> list:
        out = [None] * len(requests)
        # One batch per generation budget: the canvas length is shared by a batch's rows.
        groups = {}
        for i, request in enumerate(requests):
            context, options = request.args
            n = self.max_tokens or options.get("max_gen_toks") or 256
            groups.setdefault(n, []).append(i)
        for n, rows in groups.items():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                prompts = [requests[i].args[0] for i in chunk]
                texts = batch_generate_diffusion(
                    self.model, self.tokenizer, prompts, max_tokens=n, **self.overrides
                ).texts
                for i, text in zip(chunk, texts):
                    out[i] = _cut_at(text, requests[i].args[1].get("until"))
        return out


def check_flags(args):
    """The flags that fail late or silently in lm-eval, checked before anything loads: an empty
    task name, an --include-path that is not a folder (lm-eval scans only folders, and ignored a
    missing one), the likelihood's sample counts."""
    if not args.tasks or any(not t.strip() for t in args.tasks):
        raise SettingsError(
            f"--tasks names no task ({' '.join(map(repr, args.tasks))}): give lm-eval task names "
            "(`lm-eval ls tasks` lists them) or task YAML files"
        )
    if args.include_path is not None:
        path = Path(args.include_path)
        if not path.exists():
            raise SettingsError(
                f"--include-path {path}: no such folder; give the folder of your task YAML files"
            )
        if not path.is_dir():
            raise SettingsError(
                f"--include-path {path} is a file: give the folder that holds it (a task's YAML "
                "file can also go straight to --tasks)"
            )
    check_counts(args.mc_samples, min(args.batch_size, args.mc_samples), args.cfg_scale)


def check_tasks(task_manager, tasks):
    """Every task a name lm-eval knows (a task, group or tag, --include-path's included) or a task
    YAML file; lm-eval raises a bare KeyError otherwise, after the model has loaded."""
    known = set(task_manager.all_tasks)
    unknown = [t for t in tasks if t not in known and not Path(t).is_file()]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        hints.append(f"{name!r}{hint}")
    raise SettingsError(
        f"unknown task {'; '.join(hints)}: not an lm-eval task, group or tag, nor a task YAML "
        "file (`lm-eval ls tasks` lists them; your own tasks: --include-path DIR)"
    )


def main(argv):
    from .loader import load

    args = build_parser().parse_args(argv)
    check_flags(args)
    task_manager = TaskManager(include_path=args.include_path)
    check_tasks(task_manager, args.tasks)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_path = model_or_default(args.model)
    kwargs = {"tokenizer_config": {"trust_remote_code": args.trust_remote_code}}
    if args.adapter_path:
        kwargs["adapter_path"] = args.adapter_path
    model, tokenizer = load(model_path, **kwargs)
    lm = DiffusionLM(
        model,
        tokenizer,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        use_chat_template=args.apply_chat_template,
        chat_template_args=args.chat_template_args,
        mc_samples=args.mc_samples,
        cfg_scale=args.cfg_scale,
        seed=args.seed,
        settings={"temperature": args.temp, "seed": args.seed},
    )
    # Every stream lm_eval seeds (Python's, numpy's, torch's, the few-shot sampler's): --seed.
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=args.tasks,
        task_manager=task_manager,
        fewshot_as_multiturn=args.fewshot_as_multiturn,
        apply_chat_template=lm.use_chat_template,
        num_fewshot=args.num_shots,
        limit=args.limit,
        **dict.fromkeys(LM_EVAL_SEEDS, args.seed),
        confirm_run_unsafe_code=args.confirm_run_unsafe_code,
    )
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    keys = ["eval", str(model_path).strip("/").replace("/", "_"), version("lm_eval")]
    keys += [f"{args.num_shots:02d}"] if args.num_shots is not None else []
    (output_dir / "_".join(keys + args.tasks)).write_text(json.dumps(results["results"], indent=4))
    print("Results:")
    for result in results["results"].values():
        print(json.dumps(result, indent=4))
    return results
