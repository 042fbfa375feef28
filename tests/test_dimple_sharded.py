"""Dimple over two ranks of MLX's ring backend (mlx.launch on loopback): the language model split as
Dream's, the vision tower and projector replicated. Each rank's logits over an image prompt are
bitwise the same and within reduction noise of one process, and greedy tokens with an image (under
the recipe's prefill cache) are one process's.

It runs with MLX_DLLM_SLOW_TESTS=1 only: three processes that each import mlx-vlm and transformers
take 40-80 s on two CPU cores, past what the suite's budget holds for one family (Model.shard over
one rank and the refusal of three are in test_dimple.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from fixtures.dimple import build
from helpers import assert_sharded_is_one_process, launch_two_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        os.environ.get("MLX_DLLM_SLOW_TESTS") != "1",
        reason="three processes of mlx-vlm take a minute on CPU: set MLX_DLLM_SLOW_TESTS=1",
    ),
]

PYTHON = sys.executable

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
ids = [257, 72, 261] + model.image_slots(*processor.preprocess(image)) + [262, 260, 260, 260]
logits = np.array(model(mx.array([ids])).astype(mx.float32))
settings = dict(max_tokens=8, steps=4, temperature=0.0, alg="maskgit_plus")
prompt = processor.image_token + "describe"
tokens = [
    t
    for r in stream_generate_diffusion(model, processor, prompt, image=image, **settings)
    for t in r.tokens
]
np.savez(f"{out}/rank{rank}.npz", logits=logits, tokens=np.array(tokens), weights=weights)
"""


def test_two_ranks_compute_one_process_logits_and_tokens(tmp_path):
    path = build(tmp_path / "dimple")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    proc = subprocess.run(
        [PYTHON, str(worker), str(path), str(single)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = launch_two_ranks(worker, path, sharded, out=sharded)
    one = np.load(single / "rank0.npz")
    assert_sharded_is_one_process(one, ranks)
    assert ranks[1]["weights"] < one["weights"]  # each rank holds its share of the text weights
