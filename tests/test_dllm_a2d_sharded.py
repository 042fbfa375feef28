"""dllm's A2D Qwen3 over two ranks of MLX's ring backend (mlx.launch on loopback, through
tests/distributed_worker.py, as tests/test_rnd1_coda_sharded.py runs RND1 and CoDA): each rank's
logits are bitwise the same, within reduction noise of one process, and the generated tokens at the
samplers mdlm (bidirectional, the default) and bd3lm (block-causal over the prefix cache) are one
process's."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from distributed_worker import run

from fixtures.dllm import build

pytestmark = pytest.mark.distributed

PYTHON = sys.executable
LAUNCH = Path(PYTHON).parent / "mlx.launch"
WORKER = Path(__file__).with_name("distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_compute_one_process_logits_and_tokens(tmp_path):
    path = str(build(tmp_path / "a2d"))
    settings = {"max_tokens": 8, "block_length": 4, "steps": 3}
    plan = {
        "checkpoints": {
            name: {
                "path": path,
                "prompt": [65, 66, 67, 68, 69, 70],
                "settings": {**settings, "sampler": name},
            }
            for name in ("mdlm", "bd3lm")
        }
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    run(plan, tmp_path / "single")
    if not LAUNCH.exists():
        pytest.fail(f"mlx.launch is not next to {PYTHON}; install mlx into this environment")
    out = tmp_path / "sharded"
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "-p", str(_free_port())]
    cmd += ["--python", PYTHON, str(WORKER), str(tmp_path / "plan.json"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    for rank in (0, 1):
        assert (out / f"rank{rank}.npz").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    one = np.load(tmp_path / "single" / "rank0.npz")
    ranks = [np.load(out / f"rank{r}.npz") for r in (0, 1)]
    for name in ("mdlm", "bd3lm"):
        logits = f"{name}/logits"
        np.testing.assert_array_equal(ranks[0][logits], ranks[1][logits], err_msg=name)
        scale = np.abs(one[logits]).max()
        assert np.abs(ranks[0][logits] - one[logits]).max() <= 1e-4 * scale, name
        want = one[f"{name}/tokens"].tolist()
        assert len(want) == 8, name
        for got in ranks:
            assert got[f"{name}/tokens"].tolist() == want, name
        # Each rank holds its share of the attention and MLP weights.
        assert ranks[0][f"{name}/weights"] < one[f"{name}/weights"], name
    assert one["mdlm/tokens"].tolist() != one["bd3lm/tokens"].tolist()
