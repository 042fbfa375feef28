"""The suite's fixtures and hooks; the helpers the tests share are in tests/helpers.py."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx_dllm_models_hook  # noqa: E402,F401  (registers our model types with mlx-lm)

NO_TORCH = str(ROOT / "tests" / "no_torch")


def pytest_configure(config):
    """Every fresh interpreter the tests start runs without torch, as a user's does
    (tests/no_torch); subprocess environments copy os.environ, so setting it once here reaches
    them all. Not in pytest-xdist's controller: the workers it starts run the torch references."""
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if controller or NO_TORCH in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (NO_TORCH, os.environ.get("PYTHONPATH")) if p
    )


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """A session-wide folder; `fixture_dir / name` holds a built checkpoint."""
    return tmp_path_factory.mktemp("checkpoints")
