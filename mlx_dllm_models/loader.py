"""Loading a diffusion checkpoint: mlx_lm.load with this package's models registered, the
checkpoint checked first (clear errors instead of mlx-lm's), its generation_config attached, and
mlx-vlm's processor for checkpoints with a vision tower."""

import contextlib
import json
from pathlib import Path

import mlx_dllm_models_hook  # noqa: F401  (registers our model types with mlx-lm)

from .registry import MODEL_TYPES


class CheckpointError(ValueError):
    pass


def _check_checkpoint(path: Path):
    if not path.exists():
        raise CheckpointError(
            f"no checkpoint at {path}: give a local folder holding config.json and *.safetensors "
            "(this package does not download; convert a Hugging Face checkpoint with "
            "`python -m mlx_lm convert --hf-path DIR --mlx-path OUT`)"
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
    if config["model_type"] not in MODEL_TYPES:
        raise CheckpointError(
            f"model_type {config['model_type']!r} in {cfg_file} is not a diffusion model this package "
            f"provides; supported: {', '.join(sorted(set(MODEL_TYPES)))}. For autoregressive models "
            "use mlx_lm.load"
        )
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path} has a config.json but no *.safetensors weight files; copy the weights there "
            "(a PyTorch .bin checkpoint must be converted to safetensors first)"
        )
    return config


@contextlib.contextmanager
def _quiet_transformers():
    """AutoTokenizer reads config.json and warns that it does not know our model types: noise."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load(path, **kwargs):
    """(model, tokenizer) through mlx_lm.load, with this package's models registered, the
    checkpoint checked first, and its generation_config.json attached as `model.generation_config`.

    For a checkpoint with a vision tower (DiffusionGemma), (model, processor) as mlx_vlm.load
    returns it: mlx-vlm's processor, which places images in a prompt and serves text-only prompts
    too (`generate_diffusion(model, processor, prompt, image=[...])`)."""
    from mlx_lm.utils import load as mlx_load

    path = Path(path)
    _check_checkpoint(path)
    # Real checkpoints carry an auto_map to remote code; transformers would stop and ask on stdin
    # whether to run it. The tokenizers of the supported families do not need it, so say no unless
    # the caller opts in.
    tokenizer_config = dict(kwargs.pop("tokenizer_config", None) or {})
    tokenizer_config.setdefault("trust_remote_code", False)
    try:
        with _quiet_transformers():
            model, tokenizer = mlx_load(str(path), tokenizer_config=tokenizer_config, **kwargs)
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
        raise
    gen_file = path / "generation_config.json"
    model.generation_config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    if getattr(model, "vision_tower", None) is not None:
        from .vision import load_processor, vision_config_of

        with _quiet_transformers():
            tokenizer = load_processor(
                path, tokenizer_config["trust_remote_code"], vision_config_of(path)
            )
    return model, tokenizer
