"""RND1 and CoDA over two ranks of MLX's ring backend (mlx.launch on loopback, through
tests/distributed_worker.py, as tests/test_distributed.py runs the other families): each rank's
logits are bitwise the same, within reduction noise of one process, and the generated tokens at the
families' defaults are one process's."""

import json
from pathlib import Path

import numpy as np
import pytest
from distributed_worker import run

from conftest import assert_sharded_is_one_process, launch_two_ranks
from fixtures.coda import build as build_coda
from fixtures.rnd1 import build as build_rnd1

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
FAMILIES = {"rnd1": build_rnd1, "coda": build_coda}
PROMPT = [65, 66, 67, 68, 69, 70]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_rnd1_coda")
    checkpoints = {
        name: {
            "path": str(build(root / name)),
            "prompt": PROMPT,
            # The defaults (RND1: sampled at 0.01; CoDA: alg_temp 0.1), fewer tokens and steps.
            "settings": {"max_tokens": 8, "steps": 4},
        }
        for name, build in FAMILIES.items()
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
        assert_sharded_is_one_process(one, ranks, name, tokens=8)
