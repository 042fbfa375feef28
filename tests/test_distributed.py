"""Tensor parallelism (each family's `Model.shard`, `load(..., group=...)`) over MLX's ring backend:
two processes on loopback launched by `mlx.launch`, against one process.

One launch runs every family (tests/distributed_worker.py), `mlx_dllm generate` and `mlx_dllm
serve` (concurrent requests, then SIGTERM to rank 0); a second pair of processes checks that a rank
that dies ends the other with an error instead of a hang.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distributed_worker import run
from fixtures import all_checkpoints
from helpers import free_port, launch_two_ranks
from mlx_dllm_models import load, stream_generate_diffusion
from mlx_dllm_models.tiny import build_tiny_llada
from mlx_dllm_models.vision import text_tokenizer

pytestmark = pytest.mark.distributed

PYTHON = sys.executable
WORKER = Path(__file__).with_name("distributed_worker.py")

FAMILIES = (
    "llada",
    "llada_moe",
    "dream",
    "sdar",
    "sdar_moe",
    "llada2_moe",
    "nemotron",
    "nemotron_tied",
    "diffusion_gemma",
)
PROMPT = [65, 66, 67, 68, 69, 70]
SETTINGS = {"dream": {"steps": 8}, "diffusion_gemma": {"max_denoising_steps": 4}}
# Large enough that the sharded layers dominate the replicated embeddings and head: 8 layers of
# d_model 512 (about 84 MB of float32 weights, 0.3 MB of them replicated, 2 MB the largest).
BIG = dict(d_model=512, n_layers=8, n_heads=8, mlp_hidden_size=1024)
# Concurrent requests to the sharded server: completions and a chat, one streamed, two settings
# groups (so that groups take turns block by block) and several blocks each.
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]
SERVE = {
    "completion": {"prompt": "Once upon a time", "max_tokens": 16, "block_length": 8},
    "streamed": {"prompt": "hello world", "max_tokens": 16, "block_length": 8, "stream": True},
    "chat": {"messages": CHAT, "max_tokens": 16, "block_length": 8},
    "other_group": {"prompt": "a b c d", "max_tokens": 12, "block_length": 4, "steps": 2},
    # Streamed; its client hangs up after the first block: rank 0 shares the cancellation and
    # every rank drops the row at the same block (else their batches, and collectives, differ).
    "disconnected": {"prompt": "tell me more", "max_tokens": 64, "block_length": 8, "stream": True},
}


def _text_only(path: Path) -> Path:
    # The vision tower is replicated and mlx-vlm's processor is slow to load; the text stack is
    # what is sharded.
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("vision_config", None)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    builders = all_checkpoints()
    checkpoints = {
        "big": {"path": str(build_tiny_llada(root / "big", **BIG)), "memory_only": True},
    }
    for name in FAMILIES:
        path = builders[name](root / name)
        if name == "diffusion_gemma":
            _text_only(path)
        settings = dict(SETTINGS.get(name, {}), max_tokens=8)
        checkpoints[name] = {"path": str(path), "prompt": PROMPT, "settings": settings}
    cli = ["generate", "--model", checkpoints["llada"]["path"], "--prompt", "hi"]
    cli += ["--max-tokens", "8", "--no-live", "--ignore-chat-template"]
    requests = {
        name: {
            "path": "/v1/chat/completions" if "messages" in body else "/v1/completions",
            "body": dict(body, temperature=0.0),
            "disconnect": name == "disconnected",
        }
        for name, body in SERVE.items()
    }
    serve = {"model": checkpoints["llada"]["path"], "port": free_port(), "requests": requests}
    plan = {"checkpoints": checkpoints, "cli": cli, "serve": serve}
    (root / "plan.json").write_text(json.dumps(plan))
    return root


@pytest.fixture(scope="module")
def single(plan):
    out = plan / "single"
    run(json.loads((plan / "plan.json").read_text()), out)
    return out


@pytest.fixture(scope="module")
def sharded(plan):
    out = plan / "sharded"
    launch_two_ranks(WORKER, plan / "plan.json", out, out=out, timeout=240)
    return out


def _results(folder: Path, rank: int = 0):
    return np.load(folder / f"rank{rank}.npz")


def test_tokens_at_temperature_0_equal_one_process_for_every_family(single, sharded):
    one, ranks = _results(single), [_results(sharded, r) for r in (0, 1)]
    checked = []
    for name in FAMILIES:
        want = one[f"{name}/tokens"].tolist()
        assert len(want) == 8, name
        for rank, got in enumerate(ranks):
            assert got[f"{name}/tokens"].tolist() == want, (name, rank)
        checked.append(name)
    assert checked == list(FAMILIES)


def test_logits_identical_on_all_ranks_and_within_reduction_noise(single, sharded):
    one, r0, r1 = _results(single), _results(sharded, 0), _results(sharded, 1)
    for name in FAMILIES:
        key = f"{name}/logits"
        # Bitwise the same on every rank: every commit decision is then the same.
        np.testing.assert_array_equal(r0[key], r1[key], err_msg=name)
        # Against one process only the summation order differs (float32: ~1e-6 of the largest
        # logit; DiffusionGemma's softcap and 30x scale make it ~2e-5).
        scale = np.abs(one[key]).max()
        assert np.abs(r0[key] - one[key]).max() <= 1e-4 * scale, name


def test_each_rank_loads_about_half_the_weights(single, sharded):
    one = _results(single)
    for rank in (0, 1):
        got = _results(sharded, rank)
        assert got["big/weights"] <= 0.55 * one["big/weights"], rank
        # Peak while loading: each rank reads its slices, not the whole checkpoint.
        assert got["big/load_peak"] <= 0.6 * one["big/load_peak"], rank


def test_cli_generate_sharded_prints_on_rank_0_only(single, sharded):
    text = (single / "cli_rank0.txt").read_text()
    assert text.strip(), "the single-process CLI printed nothing"
    assert (sharded / "cli_rank0.code").read_text() == "0"
    assert (sharded / "cli_rank1.code").read_text() == "0"
    assert (sharded / "cli_rank0.txt").read_text().split("=" * 10)[0] == text.split("=" * 10)[0]
    assert (sharded / "cli_rank1.txt").read_text() == ""


def test_serve_sharded_answers_as_one_process_and_stops_on_sigterm(plan, sharded):
    """Rank 0 served the concurrent requests, each rank decoding on its shard; each answer is the
    text of one single-process call at temperature 0. SIGTERM to rank 0 ended both ranks
    cleanly (exit status 0)."""
    answers = json.loads((sharded / "serve_answers.json").read_text())
    assert "error" not in answers, answers["error"]
    model, tokenizer = load(json.loads((plan / "plan.json").read_text())["serve"]["model"])
    checked = []
    for name, body in SERVE.items():
        settings = {k: v for k, v in body.items() if k not in ("prompt", "messages", "stream")}
        prompt = body.get("prompt")
        if prompt is None:
            prompt = text_tokenizer(tokenizer).apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=False
            )
        responses = stream_generate_diffusion(model, tokenizer, prompt, temperature=0.0, **settings)
        want = "".join(r.text for r in responses)
        assert want, name
        if name == "disconnected":  # its first block only
            assert want.startswith(answers[name]), name
        else:
            assert answers[name] == want, name
        checked.append(name)
    assert checked == list(SERVE)
    assert [(sharded / f"serve_rank{r}.code").read_text() for r in (0, 1)] == ["0", "0"]


def test_share_hands_rank_0s_object_to_every_rank(sharded):
    assert [int(_results(sharded, r)["share/from_rank"]) for r in (0, 1)] == [0, 0]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_rank_that_dies_ends_the_other_with_an_error(plan, command):
    path = json.loads((plan / "plan.json").read_text())["checkpoints"]["llada"]["path"]
    port = free_port()
    hosts = plan / f"hosts_{command}.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = dict(os.environ, MLX_HOSTFILE=str(hosts))
    generate = [PYTHON, "-m", "mlx_dllm_models", command, "--model", path]
    if command == "generate":
        generate += ["--prompt", "hi", "--max-tokens", "64", "--no-live"]
    else:  # the server's first step hands rank 0's news to a rank that is gone
        generate += ["--port", str(free_port())]
    # Rank 1 takes part in the synchronisation that ends loading, then is killed (SIGKILL: no
    # clean-up of its sockets); it needs nothing but mlx for that.
    dies = (
        "import os, signal, mlx.core as mx; g = mx.distributed.init(); "
        "mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=g)); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    tic = time.perf_counter()
    rank0 = subprocess.Popen(
        generate, env=dict(env, MLX_RANK="0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    rank1 = subprocess.Popen([PYTHON, "-c", dies], env=dict(env, MLX_RANK="1"))
    try:
        _, err = rank0.communicate(timeout=120)
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
    assert rank1.wait(timeout=10) == -9
    err = err.decode()
    assert rank0.returncode == 1, err
    assert "error: rank 0 of 2 lost contact with another rank" in err, err
    assert "Traceback" not in err
    assert time.perf_counter() - tic < 120
