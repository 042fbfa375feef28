"""What `mlx_dllm convert` adds to mlx-lm's conversion output: no remote code, and a model card.

mlx_lm.convert copies config.json (with its `auto_map`), tokenizer_config.json and the checkpoint's
`*.py` files into the output. With `auto_map` there, plain `mlx_lm.load` (through transformers'
AutoTokenizer, which reads config.json) stops for 15 s at "Do you wish to run the custom code?
[y/N]", and answering y runs that Python. The MLX models of this package never use it, so the
converted checkpoint drops both. mlx-lm also writes a model card (README.md) with an empty body;
it gets the commands that run the checkpoint.

`finish_conversion(mlx_path, hf_path)` does both on a finished output folder (or on the temporary
folder of an atomic conversion, before it is renamed into place).
"""

import importlib
import json
from pathlib import Path

from .models.common import refuse_autoregressive_tools
from .registry import MODEL_TYPES

# The JSON files of a converted checkpoint that may carry an `auto_map` to remote code.
_CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json")


def drop_remote_code(mlx_path) -> list:
    """Remove `auto_map` from the output's configs and delete the `*.py` files mlx_lm.convert
    copied next to them; returns what was removed (file names, and `file:auto_map` entries)."""
    mlx_path = Path(mlx_path)
    removed = []
    for name in _CONFIG_FILES:
        file = mlx_path / name
        if not file.exists():
            continue
        config = json.loads(file.read_text())
        if isinstance(config, dict) and "auto_map" in config:
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


def finish_conversion(mlx_path, hf_path=None) -> Path:
    """Both steps on a converted checkpoint folder; returns the card's path."""
    drop_remote_code(mlx_path)
    return write_model_card(mlx_path, hf_path)
