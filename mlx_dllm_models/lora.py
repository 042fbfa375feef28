"""`mlx_dllm lora` and `mlx_dllm fuse`: mlx-lm's fine-tuning workflow with the masked-diffusion loss.

Everything a user of `mlx_lm.lora` knows carries over: its flags and YAML config (mlx_lm.lora's own
parser), its data formats (chat / completions / text jsonl in --data, read by
mlx_lm.tuner.datasets), its trainer (mlx_lm.tuner.trainer.train: reports, validation, periodic
saves) and its adapter files (adapters.safetensors + adapter_config.json, which `load(path,
adapter_path=...)`, `mlx_dllm generate --adapter-path` and `mlx_lm.fuse` read back). Only the loss
differs: next-token cross-entropy would train a diffusion model for a decoding it never does, so
the trainer gets LLaDA's SFT loss (training.diffusion_loss: the prompt is never masked, the answer
and its EOS padding are masked at a random rate t and weighted by 1/t).
"""

import argparse
import contextlib
import json
import sys
import types
from pathlib import Path
from typing import List, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .default import model_or_default
from .errors import CheckpointError
from .training import family_loss, sample_noise

# mlx_lm.lora's defaults that do not fit here: the embedded default model instead of a Qwen
# download, and the prompt kept out of the loss (the SFT form needs the prompt length of each row).
# The loss's noise: LLaDA's mask-rate floor (1e-3), and the batch's noise levels spread over [0, 1)
# (an unbiased, lower-variance estimate of the same loss: mlx-lm's batches are small).
DEFAULTS = {"model": None, "mask_prompt": True, "mask_eps": 1e-3, "low_discrepancy": True}


def turn_closer(tokenizer) -> List[int]:
    """The tokens the chat template writes after an assistant answer (LLaDA's `<|eot_id|>`) when
    generation does not stop at them; [] otherwise.

    LLaDA's SFT data (GUIDELINES.md, "SFT") puts the answer directly before its EOS padding:
    `...assistant<end_id>\nParis.<EOS><EOS>...`. mlx-lm's chat and completions rows end with the
    template's closer instead; trained on as they are, the model would learn to write it, and
    since it is not a stop token every answer would end in visible `<|eot_id|>` text."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "ANSWER"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": marker}],
        tokenize=False,
    )
    tail = text[text.rindex(marker) + len(marker) :]
    ids = list(tokenizer.encode(tail, add_special_tokens=False)) if tail else []
    if any(i in tokenizer.eos_token_ids for i in ids):
        return []  # generation ends there anyway
    return ids


def sft_loss(spec, eps: float = 1e-3, closer: Sequence[int] = (), low_discrepancy: bool = False):
    """A loss with mlx-lm's trainer signature `loss(model, batch, lengths) -> (loss, ntoks)`.

    `batch` (B, L) is mlx-lm's zero-padded batch and `lengths` (B, 2) its (prompt offset, length)
    per row. Past its length a row is padded with EOS, as LLaDA's SFT pads its answers (that is how
    a fixed canvas learns to end), and the masked-diffusion SFT loss is taken with the offsets as
    prompt lengths; `ntoks` counts the answer positions (mlx-lm weights validation losses by it).
    A row that ends with `closer` (turn_closer: the template's end-of-turn) has it replaced by EOS
    too, as in LLaDA's SFT data.

    `eps` is the floor of the mask probability p = (1 - eps) t + eps (LLaDA's 1e-3); a larger one
    keeps the 1/p weight of lightly masked rows from dominating a small batch's gradient.
    `low_discrepancy` spreads the batch's noise levels over [0, 1) (training.sample_noise)."""
    diffusion = family_loss(spec, eps)
    if not spec.eos_token_ids:
        raise ValueError(
            "the checkpoint's config.json has no eos_token_id, which the SFT loss pads answers "
            "with; add it"
        )
    eos = spec.eos_token_ids[0]
    closer = mx.array(list(closer), dtype=mx.int32)

    def answer_ends(batch, lengths):
        if closer.size == 0:
            return lengths[:, 1]
        k = closer.size
        end = lengths[:, 1] - k
        tail = mx.take_along_axis(batch, mx.maximum(end[:, None] + mx.arange(k), 0), axis=1)
        closed = (tail == closer).all(axis=1) & (end >= lengths[:, 0])
        return mx.where(closed, end, lengths[:, 1])

    def loss(model, batch, lengths):
        B, L = batch.shape
        positions = mx.arange(L)[None]
        tokens = mx.where(positions < answer_ends(batch, lengths)[:, None], batch, eos)
        prompt_lengths = mx.minimum(lengths[:, 0], L - 1)
        # The noise draws come from mlx's global key, which mlx-lm's compiled step tracks.
        t, u = sample_noise(None, (B, L), low_discrepancy=low_discrepancy)
        return diffusion(model, tokens, t, u, prompt_lengths), (L - prompt_lengths).sum()

    return loss


def trainer_loss(args, model, closer):
    """sft_loss for `model` with the command's --mask-eps and --low-discrepancy."""
    return sft_loss(
        model.diffusion_spec, args.mask_eps, closer, low_discrepancy=args.low_discrepancy
    )


def _optimizer(args):
    import mlx.optimizers as optim
    from mlx_lm.tuner.utils import build_schedule

    classes = {
        "adam": optim.Adam,
        "adamw": optim.AdamW,
        "muon": optim.Muon,
        "sgd": optim.SGD,
        "adafactor": optim.Adafactor,
    }
    name = args.optimizer.lower()
    if name not in classes:
        raise ValueError(f"unknown optimizer {args.optimizer!r}; one of {', '.join(classes)}")
    lr = build_schedule(args.lr_schedule) if args.lr_schedule else args.learning_rate
    return classes[name](learning_rate=lr, **args.optimizer_config.get(name, {}))


def train_model(args, model: nn.Module, train_set, valid_set, training_callback=None, closer=()):
    """mlx_lm.lora.train_model with the diffusion loss: LoRA / DoRA / full layers as
    --fine-tune-type says, adapter_config.json written first, mlx-lm's trainer. `closer`: the
    chat template's end-of-turn tokens that the loss turns into EOS padding (turn_closer)."""
    from mlx_lm.tuner.datasets import CacheDataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers, print_trainable_parameters
    from mlx_lm.utils import save_config

    mx.random.seed(args.seed)
    model.freeze()
    if args.num_layers > len(model.layers):
        # mlx-lm's default (16) exceeds small models' depth (the embedded default has 4): adapt
        # every layer, and record that count, which load_adapters reads back.
        print(
            f"--num-layers {args.num_layers}: the model has {len(model.layers)} layers; adapting "
            "all of them"
        )
        args.num_layers = len(model.layers)
    if args.fine_tune_type == "full":
        for layer in model.layers[-max(args.num_layers, 0) :]:
            layer.unfreeze()
        args.lora_parameters = None
    elif args.fine_tune_type in ("lora", "dora"):
        linear_to_lora_layers(
            model,
            args.num_layers,
            args.lora_parameters,
            use_dora=args.fine_tune_type == "dora",
        )
    else:
        raise ValueError(f"unknown --fine-tune-type {args.fine_tune_type!r}: lora, dora or full")
    if args.resume_adapter_file is not None:
        model.load_weights(args.resume_adapter_file, strict=False)
    print_trainable_parameters(model)

    adapter_path = Path(args.adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    save_config(vars(args), adapter_path / "adapter_config.json")
    training_args = TrainingArgs(
        batch_size=args.batch_size,
        iters=args.iters,
        val_batches=args.val_batches,
        steps_per_report=args.steps_per_report,
        steps_per_eval=args.steps_per_eval,
        steps_per_save=args.save_every,
        adapter_file=adapter_path / "adapters.safetensors",
        max_seq_length=args.max_seq_length,
        grad_checkpoint=args.grad_checkpoint,
        grad_accumulation_steps=args.grad_accumulation_steps,
    )
    train(
        model=model,
        optimizer=_optimizer(args),
        train_dataset=CacheDataset(train_set),
        val_dataset=CacheDataset(valid_set),
        args=training_args,
        loss=trainer_loss(args, model, closer),
        training_callback=training_callback,
    )


DATA_FORMS = (
    "one JSON object a line in mlx-lm's chat "
    '({"messages": [...]}), completions ({"prompt", "completion"}) or text ({"text"}) form'
)


def load_datasets(args, tokenizer):
    from mlx_lm.tuner.datasets import load_dataset

    data = str(args.data)
    parts = data.split("/")
    on_hub = len(parts) == 2 and all(parts) and not data.startswith((".", "~"))
    if not getattr(args, "hf_dataset", None) and not Path(data).exists() and not on_hub:
        raise ValueError(
            f"--data {data}: no such folder. Give a folder holding train.jsonl and valid.jsonl "
            f"(and test.jsonl for --test), {DATA_FORMS}, or a Hugging Face dataset id ('org/name')"
        )
    local = not getattr(args, "hf_dataset", None) and Path(data).exists()
    try:
        return local_datasets(args, tokenizer) if local else load_dataset(args, tokenizer)
    except ValueError as e:
        # Text data has no prompt to keep out of the loss: every position may be masked.
        if args.mask_prompt and "not supported for text dataset" in str(e):
            args.mask_prompt = False
            return load_datasets(args, tokenizer)
        raise


# A row's form, as mlx_lm.tuner.datasets.create_dataset tells them apart (in this order): its
# name, the arguments that may rename its fields (--prompt-feature ...), their default names.
_FORMS = (
    ("completions", ("prompt_feature", "completion_feature"), ("prompt", "completion")),
    ("chat", ("chat_feature",), ("messages",)),
    ("text", ("text_feature",), ("text",)),
)


def _row_form(args, row):
    """(form name, its fields) of a data row, or None."""
    for form, features, defaults in _FORMS:
        fields = tuple(getattr(args, f, None) or d for f, d in zip(features, defaults))
        if all(f in row for f in fields):
            return form, fields
    return None


def _form_text(form) -> str:
    """'text ({"text"})': a form's name and its fields."""
    name, fields = form
    return f"{name} ({{{', '.join(json.dumps(f) for f in fields)}}})"


def _row_problem(form, fields, row):
    """What is wrong with the values of a row of `form`, or None."""
    if form == "chat":
        messages = row[fields[0]]
        ok = isinstance(messages, list) and messages
        if not ok or not all(isinstance(m, dict) and "role" in m for m in messages):
            return f'"{fields[0]}" must be a non-empty list of {{"role", "content"}} messages'
        return None
    for field in fields:
        if not isinstance(row[field], str):
            return f'"{field}" must be a string, got {type(row[field]).__name__}'
    return None


def read_jsonl(file: Path, args) -> list:
    """The rows of one data file, checked as mlx-lm's datasets will read them: each line a JSON
    object of one form, the first row's (mlx-lm picks the form from it and reads every row so,
    mid-training). Blank lines are skipped. A ValueError names the file and the line."""
    rows, first = [], None
    with open(file, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise ValueError(f"{file} is not UTF-8 text ({e.reason}); save it as UTF-8") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{file} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: not valid JSON ({e.msg}, column {e.colno}); each line is {DATA_FORMS}"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{where}: a JSON object is expected, got {type(row).__name__}; each line is "
                f"{DATA_FORMS}"
            )
        form = _row_form(args, row)
        if form is None:
            keys = ", ".join(sorted(row)) or "none"
            raise ValueError(
                f"{where}: no prompt / completion, messages or text field (its keys: {keys}); "
                f"each line is {DATA_FORMS}"
            )
        if first is None:
            first = (number, form)
        elif form != first[1]:
            raise ValueError(
                f"{where}: a {_form_text(form)} row among {_form_text(first[1])} rows (line "
                f"{first[0]} is one): every row of a file must take the same form"
            )
        why = _row_problem(*form, row)
        if why:
            raise ValueError(f"{where}: {why}")
        rows.append(row)
    return rows


def local_datasets(args, tokenizer):
    """(train, valid, test) from a local --data folder, as mlx_lm.tuner.datasets reads them,
    each file checked first (read_jsonl); only the files the run uses are read (train and valid
    for --train, test for --test). A file that is there but empty is an error; a missing
    valid.jsonl means training without validation, as in mlx-lm."""
    from mlx_lm.tuner.datasets import create_dataset

    folder = Path(args.data)
    if not folder.is_dir():
        raise ValueError(
            f"--data {folder} is a file: give the folder holding train.jsonl and valid.jsonl "
            "(and test.jsonl for --test)"
        )
    used = {"train": args.train, "valid": args.train, "test": args.test}
    out = []
    for name, needed in used.items():
        file = folder / f"{name}.jsonl"
        if not needed or not file.exists():
            if needed and name != "valid":
                flag = "--train" if name == "train" else "--test"
                raise ValueError(f"{flag} needs {file}, which is not there ({DATA_FORMS})")
            if needed:
                print(f"{file} is not there: training without validation")
            out.append([])
            continue
        rows = read_jsonl(file, args)
        if not rows:
            also = " or remove it to train without validation" if name == "valid" else ""
            raise ValueError(f"{file} is empty: give it rows ({DATA_FORMS}){also}")
        out.append(create_dataset(rows, tokenizer, args))
    return tuple(out)


def run(args, training_callback=None):
    """mlx_lm.lora.run with this package's loader (repo ids, checks) and loss."""
    from mlx_lm.tuner.datasets import CacheDataset
    from mlx_lm.tuner.trainer import evaluate
    from mlx_lm.tuner.utils import load_adapters

    from .loader import load

    if not 0 < args.mask_eps < 1:
        raise ValueError(
            f"--mask-eps {args.mask_eps}: the floor of the mask rate must be in (0, 1) (the loss "
            "divides by the rate); LLaDA's is 1e-3, 0.3 steadies small batches"
        )
    check_adapter_paths(args)
    # mlx-lm's trainer draws the batch order from numpy's global generator: --seed fixes it too, as
    # mlx_lm.lora.run does (without it two runs with the same seed see different batches).
    np.random.seed(args.seed)
    args.model = model_or_default(args.model)
    model, tokenizer = load(
        args.model, tokenizer_config={"trust_remote_code": args.trust_remote_code}
    )
    train_set, valid_set, test_set = load_datasets(args, tokenizer)
    closer = turn_closer(tokenizer)
    if args.train:
        train_model(args, model, train_set, valid_set, training_callback, closer)
    elif args.test:
        if args.adapter_path:
            load_adapters(model, args.adapter_path)
    else:
        raise ValueError("give --train, --test or both")
    if args.test:
        test_loss = evaluate(
            model=model,
            dataset=CacheDataset(test_set),
            batch_size=args.batch_size,
            num_batches=args.test_batches,
            max_seq_length=args.max_seq_length,
            loss=trainer_loss(args, model, closer),
        )
        print(f"Test loss (masked-diffusion ELBO bound per answer token) {test_loss:.3f}")
    return model, tokenizer


def check_adapter_paths(args):
    """The adapter flags' paths, before the model loads: --adapter-path must be a folder (or not
    there yet, when training), --resume-adapter-file an existing file."""
    adapters = Path(args.adapter_path) if args.adapter_path else None
    if adapters is not None and adapters.exists() and not adapters.is_dir():
        raise ValueError(
            f"--adapter-path {adapters} is a file: give a folder, where the adapters "
            "(adapters.safetensors, adapter_config.json) are written"
        )
    if args.test and not args.train and adapters is not None and not adapters.is_dir():
        raise ValueError(f"--adapter-path {adapters}: no such folder of adapters to test")
    resume = args.resume_adapter_file
    if resume is not None and not Path(resume).is_file():
        kind = "a folder" if Path(resume).is_dir() else "no such file"
        raise ValueError(
            f"--resume-adapter-file {resume}: {kind}; give the adapters.safetensors of an "
            "earlier run"
        )


def parse_args(argv):
    """mlx_lm.lora's flags and YAML config, with this package's defaults."""
    import yaml
    from mlx_lm.lora import CONFIG_DEFAULTS, build_parser, yaml_loader

    parser = build_parser()
    parser.prog = "mlx_dllm lora"
    parser.description = (
        "Fine-tune a diffusion language model with mlx-lm's data formats, trainer and adapter "
        "files, and the masked-diffusion SFT loss (the prompt is never masked)."
    )
    parser.add_argument(
        "--mask-eps",
        type=float,
        help="floor of the loss's mask probability p = (1 - eps) t + eps (default 1e-3, LLaDA's); "
        "a larger one lowers the variance of small batches",
    )
    parser.add_argument(
        "--low-discrepancy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="spread each batch's noise levels t evenly over [0, 1) (default) instead of drawing "
        "them independently as LLaDA does: the same objective, a lower-variance estimate",
    )
    if not list(argv):
        # mlx_lm.lora's defaults would fetch a dataset and a model before saying anything.
        parser.error(
            "no arguments: give --train --data DIR (or -c CONFIG.yaml); --help lists the flags"
        )
    args = vars(parser.parse_args(argv))
    if args.get("config"):
        with open(args["config"]) as f:
            for k, v in yaml.load(f, yaml_loader).items():
                if args.get(k) is None:
                    args[k] = v
    for k, v in {**CONFIG_DEFAULTS, **DEFAULTS}.items():
        if args.get(k) is None:
            args[k] = v
    return types.SimpleNamespace(**args)


def lora_main(argv):
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    return 0


@contextlib.contextmanager
def _fuse_argv(argv):
    """mlx-lm's fuse reads its flags from sys.argv: set for the call, then put back."""
    saved = sys.argv
    sys.argv = ["mlx_dllm fuse"] + list(argv)
    try:
        yield
    finally:
        sys.argv = saved


def check_fuse_paths(args):
    """Before any work: adapters that are there, a model folder (or repo id) that is there, and a
    --save-path that is neither of them (fusing into the model's folder overwrote its weights,
    config and tokenizer, then failed)."""
    from .loader import resolve_checkpoint

    adapters = Path(args.adapter_path)
    missing = [
        n for n in ("adapters.safetensors", "adapter_config.json") if not (adapters / n).is_file()
    ]
    if not adapters.is_dir() or missing:
        if adapters.is_dir():
            where = "holds no " + " and no ".join(missing)
        else:
            where = "is a file" if adapters.exists() else "is not there"
        raise SystemExit(
            f"error: --adapter-path {adapters} {where}: give the folder `mlx_dllm lora` wrote "
            "adapters.safetensors and adapter_config.json in"
        )
    model = resolve_checkpoint(args.model)
    if not model.is_dir():
        raise CheckpointError(
            f"--model {args.model}: no checkpoint folder there (nor a Hugging Face repo id)"
        )
    save = Path(args.save_path).resolve()
    for flag, folder, name in (
        ("--model", model, "model's"),
        ("--adapter-path", adapters, "adapter"),
    ):
        if save == folder.resolve():
            raise SystemExit(
                f"error: --save-path {args.save_path} is the {name} folder ({flag}): fusing into it "
                "would overwrite it; choose a new folder"
            )


def fuse_main(argv):
    """mlx_lm.fuse (adapters folded into the weights, saved as a checkpoint), then the same
    remote-code removal and model card as `mlx_dllm convert`. The fused checkpoint is written
    beside --save-path and renamed into place once complete (conversion.atomic_output): an
    existing --save-path, the model's folder or the adapters' among them, is refused."""
    import importlib

    from .conversion import atomic_output, finish_conversion

    # `mlx_lm.fuse` the attribute may be shadowed; the module holds the CLI's main().
    fuse = importlib.import_module("mlx_lm.fuse")
    with _fuse_argv(argv):
        args = fuse.parse_arguments()
    check_fuse_paths(args)
    with atomic_output(args.save_path, "--save-path") as out:
        # argparse keeps an option's last value: mlx-lm's fuse writes into the temporary folder.
        with _fuse_argv([*argv, "--save-path", str(out)]):
            try:
                fuse.main()
            except ValueError as e:
                raise SystemExit(f"error: {e}") from None
        finish_conversion(out, None)
    return 0
