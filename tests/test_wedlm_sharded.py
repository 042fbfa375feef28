"""WeDLM over two ranks of MLX's ring backend (mlx.launch on loopback, through
tests/distributed_worker.py, as tests/test_distributed.py runs the other families), both bodies
(Qwen3: q/k norms; Qwen2.5: q/k/v biases): each rank's logits are bitwise the same, within
reduction noise of one process, and the tokens of the `wedlm` decoder at its defaults are one
process's."""

import json
from pathlib import Path

import numpy as np
import pytest
from distributed_worker import run

from conftest import assert_sharded_is_one_process, launch_two_ranks
from fixtures.wedlm import build, build_qwen2

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
FAMILIES = {"wedlm": build, "wedlm_qwen2": build_qwen2}
PROMPT = [65, 66, 67, 68, 69, 70]


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
    out = plan / "sharded"
    ranks = launch_two_ranks(WORKER, plan / "plan.json", out, out=out)
    one = np.load(single / "rank0.npz")
    for name in FAMILIES:
        assert_sharded_is_one_process(one, ranks, name, tokens=16)
