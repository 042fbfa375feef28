"""Open-dCoder and BD3-LM over two ranks of MLX's ring backend (mlx.launch on loopback, through
tests/distributed_worker.py, as tests/test_distributed.py runs the first families): each rank's
logits are bitwise the same, within reduction noise of one process, and the tokens at the
families' defaults (sampled: Open-dCoder's p2 at temperature 0.5, BD3-LM's nucleus at 1) are one
process's."""

import json
from pathlib import Path

import numpy as np
import pytest
from distributed_worker import run

from conftest import assert_sharded_is_one_process, launch_two_ranks
from fixtures.bd3lm import build as build_bd3lm
from fixtures.open_dcoder import build_converted as build_open_dcoder

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
FAMILIES = {"open_dcoder": build_open_dcoder, "bd3lm": build_bd3lm}
PROMPT = [65, 66, 67, 68, 69, 70]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_open_dcoder_bd3lm")
    checkpoints = {
        name: {"path": str(build(root / name)), "prompt": PROMPT, "settings": {"max_tokens": 8}}
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


def test_a_group_that_does_not_divide_the_heads_is_refused(tmp_path):
    from mlx_dllm_models import SettingsError, load

    model, _ = load(build_bd3lm(tmp_path / "bd3lm"))
    group = type("Group", (), {"size": lambda self: 3, "rank": lambda self: 0})()
    with pytest.raises(SettingsError, match="bd3lm: cannot split the checkpoint over 3 ranks"):
        model.shard(group)
