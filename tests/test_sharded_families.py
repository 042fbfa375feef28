"""The families added after the first ones, over two ranks of MLX's ring backend (mlx.launch on
loopback, through tests/distributed_worker.py, as tests/test_distributed.py runs the first
families), in one launch for all of them: each rank's logits are bitwise the same and within
reduction noise of one process, the tokens at each family's defaults (sampled where the defaults
sample: RND1 at 0.01, CoDA's alg_temp, Open-dCoder's p2 at 0.5, BD3-LM's nucleus) are one
process's, and rank 0 holds less of the weights.

- WeDLM, both bodies (Qwen3: q/k norms; Qwen2.5: q/k/v biases), the `wedlm` decoder;
- RND1 (qwen3_moe read bidirectionally) and CoDA;
- dllm's A2D, samplers mdlm (bidirectional) and bd3lm (block-causal over the prefix cache);
- Fast-dLLM v2 (block-causal, sub-blocks), over a 40-token prompt;
- Open-dCoder and BD3-LM (its fused q/k/v split in three segments).
"""

import json
from pathlib import Path

import numpy as np
import pytest

from distributed_worker import run
from fixtures import bd3lm, coda, dllm, fast_dllm_v2, open_dcoder, rnd1, wedlm
from helpers import assert_sharded_is_one_process, launch_two_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
PROMPT = [65, 66, 67, 68, 69, 70]
A2D = {"max_tokens": 8, "block_length": 4, "steps": 3}
# name: (builder, the folder it writes, prompt, settings, tokens expected)
RUNS = {
    "wedlm": (wedlm.build, "wedlm", PROMPT, {"max_tokens": 16}, 16),
    "wedlm_qwen2": (wedlm.build_qwen2, "wedlm_qwen2", PROMPT, {"max_tokens": 16}, 16),
    "rnd1": (rnd1.build, "rnd1", PROMPT, {"max_tokens": 9, "steps": 4}, 8),  # 8 masks, the pad
    "coda": (coda.build, "coda", PROMPT, {"max_tokens": 8, "steps": 4}, 8),
    "a2d_mdlm": (dllm.build, "a2d", PROMPT, {**A2D, "sampler": "mdlm"}, 8),
    "a2d_bd3lm": (dllm.build, "a2d", PROMPT, {**A2D, "sampler": "bd3lm"}, 8),
    "fast_dllm_v2": (
        fast_dllm_v2.build,
        "fast_dllm_v2",
        np.random.default_rng(40).integers(0, 256, 40).tolist(),
        {"max_tokens": 40},
        None,
    ),
    "open_dcoder": (open_dcoder.build_converted, "open_dcoder", PROMPT, {"max_tokens": 8}, 8),
    "bd3lm": (bd3lm.build, "bd3lm", PROMPT, {"max_tokens": 8}, 8),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process's results, the two ranks' results), of one plan holding every family."""
    root = tmp_path_factory.mktemp("sharded_families")
    built, checkpoints = {}, {}
    for name, (build, folder, prompt, settings, _) in RUNS.items():
        if folder not in built:
            built[folder] = str(build(root / folder))
        checkpoints[name] = {"path": built[folder], "prompt": prompt, "settings": settings}
    plan = {"checkpoints": checkpoints}
    (root / "plan.json").write_text(json.dumps(plan))
    run(plan, root / "single")
    ranks = launch_two_ranks(WORKER, root / "plan.json", root / "sharded", out=root / "sharded")
    return np.load(root / "single" / "rank0.npz"), ranks


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_compute_one_process_logits_and_tokens(runs, name):
    one, ranks = runs
    assert_sharded_is_one_process(one, ranks, name, tokens=RUNS[name][4])


def test_a2d_samplers_differ(runs):
    one, _ = runs
    assert one["a2d_mdlm/tokens"].tolist() != one["a2d_bd3lm/tokens"].tolist()


def test_a_group_that_does_not_divide_bd3lms_heads_is_refused(tmp_path):
    from mlx_dllm_models import SettingsError, load

    model, _ = load(bd3lm.build(tmp_path / "bd3lm"))
    group = type("Group", (), {"size": lambda self: 3, "rank": lambda self: 0})()
    with pytest.raises(SettingsError, match="bd3lm: cannot split the checkpoint over 3 ranks"):
        model.shard(group)
