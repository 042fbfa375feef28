"""LLaDA-V over two ranks of MLX's ring backend (mlx.launch on loopback): the language model split
as LLaDA 8B's, the vision tower replicated. Each rank's logits over an image prompt are bitwise the
same and within reduction noise of one process, and greedy tokens with an image are one process's."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures.llada_v import build_llada_v

pytestmark = pytest.mark.distributed

PYTHON = sys.executable
LAUNCH = Path(PYTHON).parent / "mlx.launch"

WORKER = """
import sys
import mlx.core as mx
import numpy as np
from PIL import Image
from mlx_dllm_models import load, stream_generate_diffusion
from mlx_dllm_models.distributed import launch_group

path, out = sys.argv[1], sys.argv[2]
group = launch_group()
rank = 0 if group is None else group.rank()
before = mx.get_active_memory()
model, processor = load(path, group=group)
mx.eval(model.parameters())
weights = mx.get_active_memory() - before
rng = np.random.default_rng(3)
image = Image.fromarray((rng.random((60, 100, 3)) * 255).astype(np.uint8))
ids = [300, 72] + model.image_slots(*processor.tiles(image)) + [310, 310, 310]
logits = np.array(model(mx.array([ids])).astype(mx.float32))
settings = dict(max_tokens=16, block_length=8, steps=4)
tokens = [
    t
    for r in stream_generate_diffusion(model, processor, "<image>hi", image=image, **settings)
    for t in r.tokens
]
np.savez(f"{out}/rank{rank}.npz", logits=logits, tokens=np.array(tokens), weights=weights)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_compute_one_process_logits_and_tokens(tmp_path):
    path = build_llada_v(tmp_path / "llada_v")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    proc = subprocess.run(
        [PYTHON, str(worker), str(path), str(single)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not LAUNCH.exists():
        pytest.fail(f"mlx.launch is not next to {PYTHON}; install mlx into this environment")
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "-p", str(_free_port())]
    cmd += ["--python", PYTHON, str(worker), str(path), str(sharded)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    for rank in (0, 1):
        assert (sharded / f"rank{rank}.npz").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    one = np.load(single / "rank0.npz")
    ranks = [np.load(sharded / f"rank{r}.npz") for r in (0, 1)]
    np.testing.assert_array_equal(ranks[0]["logits"], ranks[1]["logits"])
    scale = np.abs(one["logits"]).max()
    assert np.abs(ranks[0]["logits"] - one["logits"]).max() <= 1e-4 * scale
    assert len(one["tokens"]) == 16
    for got in ranks:
        assert got["tokens"].tolist() == one["tokens"].tolist()
        assert got["weights"] < one["weights"]  # each rank holds its share of the text weights
