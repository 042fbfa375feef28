"""What a conversion of a diffusion checkpoint adds to mlx-lm's output: no remote code, a model card.

mlx-lm's `save` (which `python -m mlx_lm convert` writes with) copies config.json (with its
`auto_map`), tokenizer_config.json and the checkpoint's `*.py` files into the output. With
`auto_map` there, plain `mlx_lm.load` (transformers' AutoTokenizer, which reads config.json through
AutoConfig) stops for 15 s at "Do you wish to run the custom code? [y/N]" on a terminal, and
answering y runs that Python. The MLX models of this package never use it, so the converted
checkpoint drops both. mlx-lm also writes a model card (README.md) with an empty body; it gets the
commands that run the checkpoint. A unified family's image tokenizer (`vq_model/`, a folder of its
own) is copied beside the weights.

mlx-lm copies config.json's `torch_dtype` (and transformers 5's `dtype`) as the source states it,
whatever `--dtype` the weights were written in; mlx-lm's next conversion reads it as the default
dtype, so a float16 conversion that still said float32 doubled in size when converted again. The
output's config states the dtype its weights hold.

`finish_conversion(mlx_path, hf_path)` does all three on a finished output folder (or on the
temporary folder of an atomic conversion, before it is renamed into place). `guard_mlx_lm_utils`,
which the start-up hook applies to `mlx_lm.utils`, makes plain `python -m mlx_lm convert` do the same
for this package's model types, and plain `mlx_lm.load` not ask about remote code at all.

For the commands that write a checkpoint folder (`mlx_dllm convert`, `mlx_dllm fuse`):
`atomic_output` (a temporary folder beside the target, renamed into place on success; an existing
target refused) and `check_source` (a local source folder whose weights are all there and whole).
"""

import ast
import contextlib
import functools
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

from .errors import CheckpointError
from .image_spec import VQ_SUBFOLDERS
from .registry import MODEL_TYPES, RETYPES

# The JSON files of a converted checkpoint that may carry an `auto_map` to remote code.
_CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json")


# config.json key of a converted checkpoint: the parameters of the dropped remote code's `generate`.
REMOTE_GENERATE_KEY = "mlx_dllm_remote_generate_params"


def remote_generate_params(path, config: dict) -> frozenset:
    """Parameter names of `generate` in the checkpoint's own modeling code (the module that
    config.json's auto_map names for AutoModelForCausalLM / AutoModel), read with `ast`, never
    run; in a converted checkpoint, which has no remote code, the names drop_remote_code recorded
    under REMOTE_GENERATE_KEY; empty when there are none. It tells checkpoints apart whose config
    and tokenizer files are identical: LLaDA2.1's generate takes editing_threshold, 2.0's does
    not."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict):
        recorded = config.get(REMOTE_GENERATE_KEY)
        if isinstance(recorded, list) and all(isinstance(a, str) for a in recorded):
            return frozenset(recorded)
        return frozenset()
    for key in ("AutoModelForCausalLM", "AutoModel"):
        target = auto_map.get(key)
        if not isinstance(target, str) or "." not in target:
            continue
        module, cls = target.split("--")[-1].rsplit(".", 1)
        source = Path(path) / f"{module}.py"
        try:
            tree = ast.parse(source.read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "generate":
                        args = item.args.args + item.args.kwonlyargs
                        return frozenset(a.arg for a in args)
    return frozenset()


def drop_remote_code(mlx_path) -> list:
    """Remove `auto_map` from the output's configs and delete the `*.py` files mlx_lm.convert
    copied next to them; returns what was removed (file names, and `file:auto_map` entries). The
    parameters of the remote code's `generate` are kept in config.json (REMOTE_GENERATE_KEY)."""
    mlx_path = Path(mlx_path)
    removed = []
    for name in _CONFIG_FILES:
        file = mlx_path / name
        if not file.exists():
            continue
        config = json.loads(file.read_text())
        if isinstance(config, dict) and "auto_map" in config:
            # What the remote code's generate takes outlives the code (LLaDA2.1's defaults).
            params = remote_generate_params(mlx_path, config) if name == "config.json" else ()
            if params:
                config[REMOTE_GENERATE_KEY] = sorted(params)
            del config["auto_map"]
            file.write_text(json.dumps(config, indent=4, ensure_ascii=False) + "\n")
            removed.append(f"{name}:auto_map")
    # The output folder holds only what the conversion wrote: every .py in it is a copy of the
    # source checkpoint's remote code.
    for file in sorted(mlx_path.glob("*.py")):
        file.unlink()
        removed.append(file.name)
    return removed


def _runs_in_mlx_lm(model_type: str) -> bool:
    """Whether mlx-lm's own generate can run the family (Nemotron is also an AR model)."""
    from .models.common import refuse_autoregressive_tools  # mlx: only when a card is written

    module = importlib.import_module(f"{__package__}.models.{MODEL_TYPES[model_type]}")
    return getattr(module.Model, "make_cache", None) is not refuse_autoregressive_tools


def model_card_text(mlx_path, hf_path=None, model_type=None) -> str:
    """The body of the converted checkpoint's README.md."""
    mlx_path = Path(mlx_path)
    if model_type is None:
        model_type = json.loads((mlx_path / "config.json").read_text())["model_type"]
    name = mlx_path.name
    source = f" from [{hf_path}](https://huggingface.co/{hf_path})" if hf_path else ""
    if _runs_in_mlx_lm(model_type):
        ar_note = (
            "It also runs as an autoregressive model in mlx-lm's own tools (`mlx_lm.generate`)."
        )
    else:
        ar_note = (
            "It is not an autoregressive model: mlx-lm's `generate`, `chat`, `server`, `evaluate` "
            "and `cache_prompt` refuse it with a pointer here; run it with this package."
        )
    return f"""# {name}

A diffusion language model (`model_type: {model_type}`) converted to MLX format{source} with
mlx-dllm-models, which registers its model classes into mlx-lm and decodes them. {ar_note}

## Use with mlx-dllm-models

Install mlx-dllm-models (from its source tree: `python -m pip install .`), then:

```bash
mlx_dllm generate --model {name} --prompt "Write a haiku about the sea."
```

```python
from mlx_dllm_models import generate_diffusion, load

model, tokenizer = load("{name}")
print(generate_diffusion(model, tokenizer, "Write a haiku about the sea.", max_tokens=64))
```

`{name}` is this folder, or its Hugging Face repo id once uploaded. Fine-tune with
`mlx_dllm lora --model {name} --data DIR --train`, evaluate with
`mlx_dllm evaluate --model {name} --tasks TASK`.
"""


def write_model_card(mlx_path, hf_path=None) -> Path:
    """README.md of the output: mlx-lm's card metadata (kept when present), this package's text."""
    from huggingface_hub import ModelCard, ModelCardData

    mlx_path = Path(mlx_path)
    file = mlx_path / "README.md"
    card = ModelCard.load(file) if file.exists() else ModelCard.from_template(ModelCardData())
    card.data.library_name = "mlx"
    card.data.pipeline_tag = "text-generation"
    tags = list(card.data.tags or [])
    card.data.tags = tags + [t for t in ("mlx", "mlx-dllm-models", "diffusion") if t not in tags]
    # A local source folder is no base model anyone else can follow.
    repo = str(hf_path) if hf_path and not Path(hf_path).exists() else None
    if repo:
        card.data.base_model = repo
    card.text = model_card_text(mlx_path, repo)
    card.save(file)
    return file


# safetensors' names of the floating dtypes -> config.json's (torch's) names.
_FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
# The config.json keys (at the top level, or in a text_config) that state the weights' dtype.
_DTYPE_KEYS = ("torch_dtype", "dtype")


def weights_dtype(mlx_path):
    """The floating dtype most of the weights in `mlx_path`/*.safetensors hold (by elements; a
    quantized checkpoint's scales and unquantized layers), as config.json names it; None when
    there is none."""
    from safetensors import safe_open

    elements = Counter()
    for file in sorted(Path(mlx_path).glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                dtype = _FLOAT_DTYPES.get(tensor.get_dtype())
                if dtype is not None:
                    elements[dtype] += math.prod(tensor.get_shape())
    return elements.most_common(1)[0][0] if elements else None


def state_weights_dtype(mlx_path) -> None:
    """Make config.json's `torch_dtype` / `dtype` (where it has them, text_config's too) say the
    dtype the written weights hold."""
    dtype = weights_dtype(mlx_path)
    file = Path(mlx_path) / "config.json"
    if dtype is None or not file.exists():
        return
    config = json.loads(file.read_text())
    sections = [config, config.get("text_config")]
    changed = False
    for section in sections:
        if not isinstance(section, dict):
            continue
        for key in _DTYPE_KEYS:
            if key in section and section[key] != dtype:
                section[key] = dtype
                changed = True
    if changed:
        file.write_text(json.dumps(config, indent=4, ensure_ascii=False) + "\n")


def copy_vq_model(mlx_path, hf_path=None) -> bool:
    """The image tokenizer's folder (a unified family's `vq_model/` or `vqvae/`: its own
    config.json and weights, which mlx-lm's save does not know of) copied from a local source as
    it is."""
    if hf_path is None:
        return False
    copied = False
    for name in VQ_SUBFOLDERS:
        src = Path(hf_path) / name
        if (src / "config.json").is_file():
            shutil.copytree(src, Path(mlx_path) / name, dirs_exist_ok=True)
            copied = True
    return copied


def finish_conversion(mlx_path, hf_path=None) -> Path:
    """The steps on a converted checkpoint folder; returns the card's path."""
    drop_remote_code(mlx_path)
    state_weights_dtype(mlx_path)
    copy_vq_model(mlx_path, hf_path)
    return write_model_card(mlx_path, hf_path)


@contextlib.contextmanager
def atomic_output(target, flag: str):
    """Yield the path to write a checkpoint folder at; it becomes `target` only once the block
    completes. It is written into a temporary folder beside `target` and renamed into place: an
    interrupted or failed write leaves nothing behind (a partial folder would make a re-run refuse,
    and load would report broken weights), and nothing at `target` is ever touched: an existing
    file or folder there is refused before any work. Every failure is a one-line error
    (SystemExit) naming `flag`, the command's option for `target`: an existing target, a place
    that cannot be written (a read-only folder, a file on the way), a write that fails (a full
    disk, a read-only file system)."""
    target = Path(target)
    if target.exists() or target.is_symlink():
        kind = "" if target.is_dir() else " (it is a file)"
        raise SystemExit(
            f"error: {target} already exists; remove it or choose another {flag}{kind}"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as e:
        raise SystemExit(
            f"error: cannot write {target} ({_os_reason(e)}); choose a folder you can write to "
            f"for {flag}"
        ) from None
    try:
        out = partial / target.name
        try:
            yield out
            os.replace(out, target)
        except OSError as e:
            raise SystemExit(
                f"error: writing {target} failed ({_os_reason(e)}); nothing was left there"
            ) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _os_reason(e: OSError) -> str:
    """An OSError as one line: its reason and the path it concerns."""
    reason = e.strerror or str(e)
    return f"{reason}: {e.filename}" if e.filename else reason


def check_source(path) -> None:
    """A local checkpoint folder a conversion reads: a folder, with every shard its index lists
    and every *.safetensors file whole; a CheckpointError naming the file otherwise (mlx-lm reads
    them with mx.load, whose error names a tensor, not the file, or with a missing shard reports
    missing weights)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint folder: give the folder that holds config.json "
            "and the weights"
        )
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index} is not a valid safetensors index (JSON with a weight_map); re-download it"
            ) from None
        missing = sorted(str(name) for name in shards if not (path / str(name)).is_file())
        if missing:
            raise CheckpointError(
                f"{path} is missing weight shard(s) {', '.join(missing)} that {index.name} lists; "
                "download the missing files"
            )
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"{file} is not a complete safetensors file (truncated or damaged: {e}); "
                "re-download it"
            ) from None


@contextlib.contextmanager
def quiet_transformers():
    """AutoTokenizer reads config.json and warns that it does not know our model types: noise."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            # transformers reads SDAR's config.json and warns that its `rope_scaling` field is
            # deprecated: a note for the checkpoint's authors, not for the user loading it.
            warnings.filterwarnings(
                "ignore", message=r"`rope_scaling` is deprecated", category=FutureWarning
            )
            yield
    finally:
        hf_logging.set_verbosity(level)


def _model_type(path):
    """The model_type in `path`/config.json, or None (no such local file, not a config)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def guard_mlx_vlm_utils(utils) -> None:
    """mlx-vlm's `load_processor` (what `mlx_vlm.load` and `mlx_vlm.convert` call), for this
    package's model types: transformers' AutoProcessor reads config.json through AutoConfig, and
    a checkpoint with an `auto_map` (LaViDa's) makes it ask "Do you wish to run the custom code?"
    on a terminal, or fails (`mlx_vlm.convert` passes trust_remote_code=True by default, and the
    remote files need not be there). The processors of these model types are their tokenizers and
    need no remote code, so `trust_remote_code=False` is passed whatever the caller's default; the
    start-up hook calls this once mlx_vlm.utils is executed. `load` returns, for a model that
    encodes its own images (vision.model_processor), that model's processor instead of the bare
    tokenizer mlx-vlm finds."""
    load_processor = utils.load_processor
    if getattr(load_processor, "__wrapped__", None) is not None:
        return
    load = utils.load

    @functools.wraps(load)
    def guarded_load(*args, **kwargs):
        # The processor that encodes the images of a model of ours, not the bare tokenizer
        # mlx-vlm finds for a checkpoint without a processor config.
        from .vision import model_processor

        model, processor = load(*args, **kwargs)
        return model, model_processor(model, processor)

    utils.load = guarded_load

    @functools.wraps(load_processor)
    def guarded_load_processor(model_path, *args, **kwargs):
        if _model_type(model_path) not in MODEL_TYPES:
            return load_processor(model_path, *args, **kwargs)
        kwargs["trust_remote_code"] = False
        with quiet_transformers():
            try:
                return load_processor(model_path, *args, **kwargs)
            except ImportError:
                # The transformers processor a processor_config.json names needs a library
                # that is not installed (SDAR-VL's LlavaOnevisionProcessor: torchvision, for its
                # video processor); `load` replaces it with the model's own, around the tokenizer.
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)

    utils.load_processor = guarded_load_processor


def guard_mlx_lm_utils(utils) -> None:
    """Adjust mlx-lm's `load_tokenizer` and `save` (mlx_lm.utils, which `mlx_lm.load` and
    `python -m mlx_lm convert` call) for this package's model types; the start-up hook calls it
    once the module is executed, before `mlx_lm.convert` binds `save`.

    * load_tokenizer: the checkpoints of these families carry an `auto_map` to remote code, and
      transformers' AutoTokenizer, asked without `trust_remote_code`, reads config.json through
      AutoConfig and stops for 15 s at "Do you wish to run the custom code? [y/N]" on a terminal
      (then goes on without it). Their tokenizers need no remote code: unless the caller says
      otherwise, `trust_remote_code=False` is passed, so nothing asks and nothing runs.
    * save: the output of a conversion (or fuse) gets finish_conversion, as `mlx_dllm convert`
      gives it: no `auto_map` or `*.py` remote code, and this package's model card."""
    load_tokenizer = utils.load_tokenizer
    if getattr(load_tokenizer, "__wrapped__", None) is None:

        @functools.wraps(load_tokenizer)
        def guarded_load_tokenizer(model_path, tokenizer_config_extra=None, *args, **kwargs):
            if _model_type(model_path) not in MODEL_TYPES:
                return load_tokenizer(model_path, tokenizer_config_extra, *args, **kwargs)
            extra = dict(tokenizer_config_extra or {})
            extra.setdefault("trust_remote_code", False)
            with quiet_transformers():
                return load_tokenizer(model_path, extra, *args, **kwargs)

        utils.load_tokenizer = guarded_load_tokenizer

    save = utils.save
    if getattr(save, "__wrapped__", None) is None:

        @functools.wraps(save)
        def guarded_save(dst_path, src_path_or_repo, model, tokenizer, config, *args, **kwargs):
            # save_config pops vision_config from `config` itself.
            vision = config.get("vision_config") if isinstance(config, dict) else None
            save(dst_path, src_path_or_repo, model, tokenizer, config, *args, **kwargs)
            if isinstance(config, dict) and config.get("model_type") in MODEL_TYPES:
                keep_vision_config(dst_path, model, vision)
                finish_conversion(dst_path, src_path_or_repo)

        utils.save = guarded_save
        # Bound before the hook was installed (a process that imported mlx-lm first).
        convert = sys.modules.get("mlx_lm.convert")
        if convert is not None and getattr(convert, "save", None) is save:
            convert.save = guarded_save


def keep_vision_config(dst_path, model, vision) -> None:
    """mlx-lm's save keeps `vision_config` only for a tower at `model.model.vision_tower`; a
    model of ours whose tower sits at `model.vision_tower` (SDAR-VL's checkpoint names) needs that
    config (`vision`) as much to load again."""
    if not vision or getattr(model, "vision_tower", None) is None:
        return
    path = Path(dst_path) / "config.json"
    written = _read_json(path)
    if isinstance(written, dict) and "vision_config" not in written:
        written["vision_config"] = vision
        path.write_text(json.dumps(written, indent=4, sort_keys=True) + "\n")


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def tokenizer_mask_id(path):
    """The id of the mask token that the checkpoint's tokenizer declares (tokenizer_config.json's
    `mask_token`, looked up in its added tokens, added_tokens.json or tokenizer.json), or None."""
    path = Path(path)
    cfg = _read_json(path / "tokenizer_config.json")
    name = cfg.get("mask_token") if isinstance(cfg, dict) else None
    name = name.get("content") if isinstance(name, dict) else name
    if not isinstance(name, str):
        return None
    for idx, entry in (cfg.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("content") == name:
            return int(idx)
    added = _read_json(path / "added_tokens.json")
    if isinstance(added, dict) and isinstance(added.get(name), int):
        return added[name]
    tok = _read_json(path / "tokenizer.json")
    if isinstance(tok, dict):
        for entry in tok.get("added_tokens") or ():
            if isinstance(entry, dict) and entry.get("content") == name:
                return entry.get("id")
    return None


def retyped_config(source, model_type: str) -> dict:
    """The config.json entries that `mlx_dllm convert --model-type` writes over the source's: the
    model_type, and the tokenizer's mask id where config.json names none (Open-dCoder's "<M>"
    lives in its tokenizer only)."""
    if model_type not in RETYPES:
        raise CheckpointError(
            f"--model-type {model_type!r} is not one this package writes; choose one of "
            f"{', '.join(RETYPES)} (families saved under another model_type)"
        )
    config = _read_json(Path(source) / "config.json") or {}
    found, bodies = config.get("model_type"), RETYPES[model_type]
    if found != model_type and found not in bodies:
        raise CheckpointError(
            f"--model-type {model_type} converts a checkpoint saved as {' / '.join(bodies)}; "
            f"{source} has model_type {found!r}"
        )
    out = {"model_type": model_type}
    if config.get("mask_token_id") is None:
        mask = tokenizer_mask_id(source)
        if mask is None:
            raise CheckpointError(
                f"{source}: neither config.json nor the tokenizer names a mask token, which a "
                f"masked-diffusion {model_type} checkpoint has; is it one? (add mask_token_id to "
                "config.json if so)"
            )
        out["mask_token_id"] = mask
    return out


def diffusion_hint(path, config) -> str:
    """For a checkpoint the loader refuses: a pointer to `--model-type` when its model_type is an
    autoregressive body that a RETYPES family is saved under and its tokenizer has a mask token
    (what a masked-diffusion checkpoint needs, and a plain AR one has no use for); else ""."""
    found = config.get("model_type")
    types = [t for t, bodies in RETYPES.items() if found in bodies]
    if not types or tokenizer_mask_id(path) is None:
        return ""
    return (
        f". Its tokenizer has a mask token: if it is a masked-diffusion model saved as {found} "
        f"({' / '.join(types)}), convert it with `mlx_dllm convert --hf-path {path} --mlx-path OUT "
        f"--model-type {types[0]}`"
    )
