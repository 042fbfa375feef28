"""WeDLM over two ranks of MLX's ring backend (mlx.launch on loopback, through
tests/distributed_worker.py, as tests/test_distributed.py runs the other families), both bodies
(Qwen3: q/k norms; Qwen2.5: q/k/v biases): each rank's logits are bitwise the same, within
reduction noise of one process, and the tokens of the `wedlm` decoder at its defaults are one
process's."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from distributed_worker import run

from fixtures.wedlm import build, build_qwen2

pytestmark = pytest.mark.distributed

PYTHON = sys.executable
LAUNCH = Path(PYTHON).parent / "mlx.launch"
WORKER = Path(__file__).with_name("distributed_worker.py")
FAMILIES = {"wedlm": build, "wedlm_qwen2": build_qwen2}
PROMPT = [65, 66, 67, 68, 69, 70]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_wedlm")
    checkpoints = {
        name: {"path": str(b(root / name)), "prompt": PROMPT, "settings": {"max_tokens": 16}}
        for name, b in FAMILIES.items()
    }
    (root / "plan.json").write_text(json.dumps({"checkpoints": checkpoints}))
    return root


def test_two_ranks_compute_one_process_logits_and_tokens(plan):
    single = plan / "single"
    run(json.loads((plan / "plan.json").read_text()), single)
    if not LAUNCH.exists():
        pytest.fail(f"mlx.launch is not next to {PYTHON}; install mlx into this environment")
    out = plan / "sharded"
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "-p", str(_free_port())]
    cmd += ["--python", PYTHON, str(WORKER), str(plan / "plan.json"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    for rank in (0, 1):
        assert (out / f"rank{rank}.npz").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    one = np.load(single / "rank0.npz")
    ranks = [np.load(out / f"rank{r}.npz") for r in (0, 1)]
    for name in FAMILIES:
        logits = f"{name}/logits"
        np.testing.assert_array_equal(ranks[0][logits], ranks[1][logits], err_msg=name)
        scale = np.abs(one[logits]).max()
        assert np.abs(ranks[0][logits] - one[logits]).max() <= 1e-4 * scale, name
        want = one[f"{name}/tokens"].tolist()
        assert len(want) == 16, name
        for got in ranks:
            assert got[f"{name}/tokens"].tolist() == want, name
        # Each rank holds its share of the attention and MLP weights.
        assert ranks[0][f"{name}/weights"] < one[f"{name}/weights"], name
