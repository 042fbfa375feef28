"""dllm's A2D Qwen3 over two ranks of MLX's ring backend (mlx.launch on loopback, through
tests/distributed_worker.py, as tests/test_rnd1_coda_sharded.py runs RND1 and CoDA): each rank's
logits are bitwise the same, within reduction noise of one process, and the generated tokens at the
samplers mdlm (bidirectional, the default) and bd3lm (block-causal over the prefix cache) are one
process's."""

import json
from pathlib import Path

import numpy as np
import pytest
from distributed_worker import run

from conftest import assert_sharded_is_one_process, launch_two_ranks
from fixtures.dllm import build

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")


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
    out = tmp_path / "sharded"
    ranks = launch_two_ranks(WORKER, tmp_path / "plan.json", out, out=out)
    one = np.load(tmp_path / "single" / "rank0.npz")
    for name in ("mdlm", "bd3lm"):
        assert_sharded_is_one_process(one, ranks, name, tokens=8)
    assert one["mdlm/tokens"].tolist() != one["bd3lm/tokens"].tolist()
