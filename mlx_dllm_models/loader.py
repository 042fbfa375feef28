"""Loading a diffusion checkpoint: mlx_lm.load with this package's models registered, the
checkpoint checked first (clear errors instead of mlx-lm's), its generation_config attached, and
mlx-vlm's processor for checkpoints with a vision tower."""

import importlib
import json
import typing
from pathlib import Path

import mlx_dllm_models_hook  # noqa: F401  (registers our model types with mlx-lm)

from .conversion import diffusion_hint, quiet_transformers, remote_generate_params
from .errors import (
    CheckpointError,  # noqa: F401  (raised here, so callers may catch it as loader's)
    SettingsError,
)
from .registry import MODEL_TYPES


def _looks_like_repo_id(name: str) -> bool:
    # "org/name" as mlx-lm's users write it; a bare name is taken as a (missing) local folder, so
    # that a typo in a folder name is reported as such rather than as a Hub lookup.
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_checkpoint(path_or_repo, revision=None) -> Path:
    """A local folder as given, or a Hugging Face repo id resolved as `mlx_lm.load` resolves it
    (huggingface_hub's snapshot_download of mlx-lm's DEFAULT_ALLOW_PATTERNS, `revision`, the
    Hugging Face cache, HF_HUB_OFFLINE)."""
    path = Path(path_or_repo)
    if path.exists() or not _looks_like_repo_id(str(path_or_repo)):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    repo = str(path_or_repo)
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(
            snapshot_download(repo, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS)
        )
    except HFValidationError:
        return path  # not a repo id after all: the local-folder checks say what is missing
    except GatedRepoError:
        raise CheckpointError(
            f"{repo} is a gated Hugging Face repo: accept its terms on huggingface.co, then log "
            "in with `hf auth login` (or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"no Hugging Face repo {repo!r} (nor a local folder of that name); check the id, or "
            "log in with `hf auth login` if it is private"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        why = (
            "downloads are off (HF_HUB_OFFLINE=1)"
            if constants.HF_HUB_OFFLINE
            else "the Hub could not be reached"
        )
        raise CheckpointError(
            f"{repo}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: "
            "download it once while online (`hf download " + repo + "`), or give a local folder"
        ) from None


def _check_checkpoint(path: Path):
    if not path.exists():
        raise CheckpointError(
            f"no checkpoint at {path}: give a local folder holding config.json and *.safetensors, "
            "or a Hugging Face repo id ('org/name'); convert a Hugging Face checkpoint with "
            "`mlx_dllm convert --hf-path DIR --mlx-path OUT`"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint folder: give the folder that holds config.json "
            "and the *.safetensors weights"
        )
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(
            f"{path} has no config.json: is it a Hugging Face / MLX checkpoint folder?"
        )
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{cfg_file} is not valid JSON ({e}); fix or re-download the file"
        ) from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{cfg_file} has no model_type field; it is not a model config")
    if not isinstance(config["model_type"], str):
        raise CheckpointError(
            f"model_type in {cfg_file} must be a string naming the architecture, got "
            f"{config['model_type']!r}; fix or re-download the file"
        )
    if config["model_type"] not in MODEL_TYPES:
        raise CheckpointError(
            f"model_type {config['model_type']!r} in {cfg_file} is not a diffusion model this package "
            f"provides; supported: {', '.join(sorted(set(MODEL_TYPES)))}. For autoregressive models "
            f"use mlx_lm.load{diffusion_hint(path, config)}"
        )
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path} has a config.json but no *.safetensors weight files; copy the weights there "
            "(a PyTorch .bin checkpoint must be converted to safetensors first)"
        )
    _check_config_types(cfg_file, config)
    _check_shards(path)
    if not any(next(path.glob(pattern), None) for pattern in _TOKENIZER_FILES):
        raise CheckpointError(
            f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); copy the tokenizer "
            "of the original checkpoint into the folder"
        )
    return config


# Files that carry a tokenizer's vocabulary; tokenizer_config.json alone does not.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken", "vocab.txt")


def _check_config_types(cfg_file: Path, config: dict):
    """config.json fields of the wrong JSON type (`"n_layers": "2"`) fail deep in the model's
    constructor with a bare TypeError; check the scalar fields of the family's ModelArgs first."""
    module = importlib.import_module(f"{__package__}.models.{MODEL_TYPES[config['model_type']]}")
    hints = typing.get_type_hints(module.ModelArgs)
    for key, value in config.items():
        hint = hints.get(key)
        if hint is None or value is None:
            continue
        kinds = tuple(t for t in typing.get_args(hint) if t is not type(None)) or (hint,)
        if len(kinds) != 1:
            continue  # unions: the model's own checks read them
        kind = kinds[0]
        # Only the plainly wrong: a quoted number or flag, a fractional count. (Some mlx-lm
        # annotations are narrower than the configs they read, e.g. a list under an `int`.)
        wrong = kind in (int, float, bool) and isinstance(value, str)
        wrong = wrong or (kind is int and isinstance(value, float) and not value.is_integer())
        if wrong:
            raise CheckpointError(
                f"{key} in {cfg_file} must be {_JSON_KIND[kind]}, got {value!r}; fix the file "
                "or re-download it"
            )


_JSON_KIND = {int: "an integer", float: "a number", bool: "true or false"}


def _check_shards(path: Path):
    """Every shard the index names is present, and every safetensors file is whole: its header
    parses and its tensors end within the file (a truncated download otherwise surfaces as mlx's
    internal 'invalid data offsets' error, or a crash)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index} is not a valid safetensors index (JSON with a weight_map); "
                "re-download it or re-convert the checkpoint"
            ) from None
        missing = sorted(name for name in shards if not (path / name).exists())
        if missing:
            raise CheckpointError(
                f"{path} is missing weight shard(s) {', '.join(missing)} that {index.name} lists; "
                "download the missing files (or re-convert the checkpoint)"
            )
    for file in sorted(path.glob("*.safetensors")):
        why = _safetensors_problem(file)
        if why:
            raise CheckpointError(
                f"{file} is not a complete safetensors file ({why}); re-download it or "
                "re-convert the checkpoint"
            )


def _safetensors_problem(file: Path):
    """Why a safetensors file is unreadable (header only: an 8-byte length, a JSON header, the
    tensors' data offsets), or None."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a header"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return "its header length runs past the end of the file"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets") or ()) == 2
    ]
    if ends and 8 + n + max(ends) > size:
        return f"its tensors need {8 + n + max(ends)} bytes, the file has {size}: truncated"
    return None


def _generation_config(gen_file: Path) -> dict:
    if not gen_file.exists():
        return {}
    try:
        gen = json.loads(gen_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{gen_file} is not valid JSON ({e}); fix or delete the file (decoding defaults then "
            "come from the family)"
        ) from None
    if not isinstance(gen, dict):
        raise CheckpointError(
            f"{gen_file} must hold a JSON object of generation settings, got "
            f"{type(gen).__name__}; fix or delete the file"
        )
    return gen


def load(
    path,
    *,
    revision: typing.Optional[str] = None,
    tokenizer_config: typing.Optional[dict] = None,
    group=None,
    **kwargs,
):
    """Load a checkpoint of a diffusion LM family through `mlx_lm.load`, with this package's
    models registered, the checkpoint checked first, and its generation_config.json attached as
    `model.generation_config`.

    Args:
        path: a local folder, or a Hugging Face repo id resolved as `mlx_lm.load` resolves it
            (downloaded into, or found in, the Hugging Face cache; `HF_HUB_OFFLINE=1` honoured).
        revision: a branch, tag or commit of a Hub repo id.
        tokenizer_config: keyword arguments for the tokenizer, as `mlx_lm.load` takes them;
            `trust_remote_code` is False unless given here (the supported tokenizers need none).
        group: an `mx.distributed` group of several ranks (e.g. `distributed.launch_group()` under
            `mlx.launch`): each rank reads and keeps only its shard of the weights.
        **kwargs: passed on to `mlx_lm.load` (`adapter_path`, `lazy`, `model_config`).

    Returns:
        (model, tokenizer); for a checkpoint with a vision tower, (model, processor) as
        `mlx_vlm.load` returns it, whose processor places images in a prompt and serves text-only
        prompts too.

    Raises:
        CheckpointError: the folder, its config, tokenizer or weights are missing or malformed;
            the message says which file and what to do.
    """
    from mlx_lm.utils import load as mlx_load

    path = resolve_checkpoint(path, revision)
    config = _check_checkpoint(path)
    # Read before mlx_lm.load, which also reads it (for eos_token_id) and would raise a bare
    # JSONDecodeError on a malformed file.
    generation_config = _generation_config(path / "generation_config.json")
    # Real checkpoints carry an auto_map to remote code; transformers would stop and ask on stdin
    # whether to run it. The tokenizers of the supported families do not need it, so say no unless
    # the caller opts in.
    tokenizer_config = dict(tokenizer_config or {})
    tokenizer_config.setdefault("trust_remote_code", False)
    if group is not None and group.size() > 1:
        from .distributed import sharded_load as mlx_load

        kwargs["group"] = group
    try:
        with quiet_transformers():
            model, tokenizer = mlx_load(str(path), tokenizer_config=tokenizer_config, **kwargs)
    except SettingsError:
        raise  # e.g. a group that cannot split the checkpoint: already says what to do
    except ValueError as e:
        msg = str(e)
        if "trust_remote_code" in msg:
            raise CheckpointError(
                f"the tokenizer in {path} needs the checkpoint's own Python code; after reviewing "
                "the .py files there, pass tokenizer_config={'trust_remote_code': True} "
                "(CLI: --trust-remote-code)"
            ) from None
        # mlx's own load_weights messages; the models' sanitize already says what is wrong.
        if msg.startswith(("Received", "Missing", "Expected shape")):
            raise CheckpointError(
                f"the weights in {path} do not match the model its config.json describes: {msg}. "
                "Check that config.json belongs to these weights (sizes, number of layers, experts)"
            ) from None
        # The models' own config checks (special ids, sizes) already say what is wrong.
        raise CheckpointError(f"{path}: {msg}") from None
    except TypeError as e:  # a config field of a type the model cannot use
        raise CheckpointError(
            f"{path / 'config.json'} holds a value the model cannot use ({e}); check the field "
            "types against the original checkpoint's config.json"
        ) from None
    model.generation_config = generation_config
    # Named in errors that only show at decoding time (non-finite logits: corrupt weights).
    model.checkpoint_path = str(path)
    model.remote_generate_params = remote_generate_params(path, config)
    load_draft_adapter(model, path)
    # On MLX's CPU backend, half-precision and quantized weights compute through float32 BLAS
    # (models/cpu_layers.py); elsewhere nothing changes.
    from .models.cpu_layers import use_float32_matmuls

    use_float32_matmuls(model)
    from .vision import load_processor, model_processor, vision_config_of

    if hasattr(model, "load_processor"):
        # LLaDA-V and the families after it: images become feature ids (as mlx_vlm.load's).
        tokenizer = model_processor(model, tokenizer)
    elif getattr(model, "vision_tower", None) is not None:
        with quiet_transformers():
            tokenizer = load_processor(
                path, tokenizer_config["trust_remote_code"], vision_config_of(path)
            )
    return model, tokenizer


def load_draft_adapter(model, path: Path) -> None:
    """Nemotron-Labs-Diffusion's self-speculation draft adapter, where the checkpoint ships it."""
    adapter = path / "linear_spec_lora"
    if hasattr(model, "load_draft_adapter") and (adapter / "adapter_config.json").is_file():
        try:
            model.load_draft_adapter(adapter)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{adapter}: the draft adapter cannot be read ({e}); remove the folder to run "
                "without it"
            ) from None


# Tensors read per evaluation while the progress bar is shown: small enough for the bar to move,
# large enough that the evaluations cost nothing next to the reading.
READ_CHUNK_BYTES = 256 << 20


def read_weights(model, progress: bool = True, delay: float = 1.5) -> None:
    """Read the weights of a model loaded with `load(path, lazy=True)`, a chunk of tensors at a
    time. With `progress`, a bar on stderr (a terminal only) once the reading has taken `delay`
    seconds: a multi-GB checkpoint takes a while, and a small one should print nothing."""
    import sys

    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = [v for _, v in tree_flatten(model.parameters())]
    chunks, chunk, size = [], [], 0
    for p in params:
        chunk.append(p)
        size += p.nbytes
        if size >= READ_CHUNK_BYTES:
            chunks.append((chunk, size))
            chunk, size = [], 0
    chunks.append((chunk, size))
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        progress = False
    if not (progress and sys.stderr.isatty()):
        mx.eval(params)
        return
    total = sum(p.nbytes for p in params)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="loading", delay=delay, leave=False
    ) as bar:
        for chunk, size in chunks:
            mx.eval(chunk)
            bar.update(size)
