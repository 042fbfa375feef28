"""The family cases of the defaults tests (tests/test_family_defaults.py,
tests/test_setting_surfaces.py): each case's config.json (a real checkpoint's under tests/data,
else a fixture's), and the spec of this package's model built from it without weights."""

import gzip
import importlib
import json
from functools import lru_cache
from pathlib import Path

from fixtures import diffusion_gemma, llada, llada2, nemotron
from mlx_dllm_models.registry import MODEL_TYPES

DATA = Path(__file__).resolve().parent / "data"


def _data_config(name):
    path = DATA / name / "config.json"
    if path.exists():
        return json.loads(path.read_text())
    return json.loads(gzip.decompress(path.with_name("config.json.gz").read_bytes()))


# Where each case's config.json comes from: a real checkpoint's, else a fixture's.
CONFIGS = {
    "llada": lambda: _data_config("GSAI-ML__LLaDA-8B-Instruct"),
    "llada_moe": llada.llada_moe_config,
    "dream": lambda: _data_config("Dream-org__Dream-v0-Instruct-7B"),
    "sdar": lambda: _data_config("JetLM__SDAR-8B-Chat"),
    "sdar_moe": lambda: _data_config("JetLM__SDAR-30B-A3B-Chat"),
    "llada2.0": lambda: _data_config("inclusionAI__LLaDA2.0-mini"),
    # 2.1's config.json is 2.0's byte for byte; its remote code's generate tells it apart (below).
    "llada2.1": lambda: _data_config("inclusionAI__LLaDA2.1-mini"),
    # 2.2: its config names the edit-control tokens.
    "llada2.2": lambda: dict(llada2.config(), delete_token_id=300, split_token_id=301),
    "nemotron": nemotron.config,
    "diffusion_gemma": lambda: dict(
        model_type="diffusion_gemma",
        text_config=dict(diffusion_gemma.TEXT_CONFIG),
        canvas_length=diffusion_gemma.CANVAS_LENGTH,
    ),
}


@lru_cache(maxsize=None)
def case_spec(case):
    config = CONFIGS[case]()
    module = importlib.import_module(f"mlx_dllm_models.models.{MODEL_TYPES[config['model_type']]}")
    return module.Model(module.ModelArgs.from_dict(config)).diffusion_spec  # lazy, never run
