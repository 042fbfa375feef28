"""The embedded default checkpoint of the CLI.

A trained model shipped inside the package (assets/default) when present; otherwise a tiny random
LLaDA checkpoint the package builds offline into the user cache, which proves the plumbing only.
"""

import os
from pathlib import Path

DEFAULT_PROMPT = "Write one short sentence about the sea."

_ASSET = Path(__file__).parent / "assets" / "default"


def default_checkpoint() -> str:
    if (_ASSET / "config.json").exists():
        return str(_ASSET)
    from .tiny import build_tiny_llada

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_dllm_models"
    path = root / "tiny-llada-v1"
    if not (path / "config.json").exists() or not (path / "tokenizer_config.json").exists():
        build_tiny_llada(path)
    return str(path)
