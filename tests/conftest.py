import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx_dllm_models_hook  # noqa: E402,F401  (registers our model types with mlx-lm)


def load_fixture(path):
    """(model, tokenizer) through mlx-lm's own loader, in float32 (fixtures are written in float32)."""
    from mlx_lm.utils import load

    return load(str(path))


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """A session-wide folder; `fixture_dir / name` holds a built checkpoint."""
    return tmp_path_factory.mktemp("checkpoints")
