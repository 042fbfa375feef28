"""mlx-lm's own tools (issue 15 §2) run from the installed wheel (tests/installed_wheel.py):
`python -m mlx_lm generate` / `cache_prompt` and mlx-lm's LoRA trainer refuse a masked diffusion
checkpoint before any forward pass and name our command, while mlx-lm's own models and
Nemotron-Labs-Diffusion (also autoregressive) still train."""

import json
import shutil
import subprocess

import pytest

from fresh_process import ROOT, clean_env

# The session's wheel and its throwaway venv (fixtures `wheel`, `installed`), built once for
# every module that loads them.
pytest_plugins = ["installed_wheel"]

# Wheels built and installed into fresh environments: the full command's, not the quick loop's.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "What is 47+85?"],
        ["cache_prompt", "--prompt", "What is 47+85?", "--prompt-cache-file", "cache.safetensors"],
    ],
    ids=lambda c: c[0],
)
def test_mlx_lm_tools_refuse_a_masked_diffusion_checkpoint_with_a_pointer(installed, command):
    """`python -m mlx_lm generate` would decode the embedded default (a LLaDA) token by token and
    print an empty answer; it must stop before any forward pass and name our command."""
    default = installed.site / "mlx_dllm_models" / "assets" / "default"
    assert (default / "config.json").exists()
    proc = subprocess.run(
        [installed.python, "-m", "mlx_lm", command[0], "--model", default, *command[1:]],
        cwd=installed.workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, proc.stdout
    assert "NotAutoregressiveError" in proc.stderr and "mlx_dllm generate" in proc.stderr, (
        proc.stderr[-2000:]
    )
    assert "Generation:" not in proc.stdout  # mlx-lm's statistics: nothing was generated
    assert not (installed.workdir / "cache.safetensors").exists()


def _lora_data(directory):
    """A completions jsonl in mlx-lm's layout (train.jsonl, valid.jsonl, test.jsonl)."""
    directory.mkdir()
    rows = [{"prompt": f"What is {a}-{b}?", "completion": str(a - b)} for a, b in [(50, 20)] * 4]
    for name in ("train", "valid", "test"):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _mlx_lm_lora(installed, module, model, data, adapters, *flags):
    return subprocess.run(
        [installed.python, "-m", *module, "--model", model, "--data", data]
        + ["--adapter-path", adapters, "--batch-size", "2", "--num-layers", "1", *flags],
        cwd=installed.workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "module, flags",
    [
        (["mlx_lm", "lora"], ["--train", "--iters", "1"]),
        (["mlx_lm.lora"], ["--train", "--iters", "1"]),  # runs lora.py as __main__
        (["mlx_lm", "lora"], ["--test", "--adapter-path", ""]),  # the next-token test loss
    ],
    ids=["python -m mlx_lm lora", "python -m mlx_lm.lora", "lora --test"],
)
def test_mlx_lm_lora_refuses_a_diffusion_checkpoint_with_a_pointer(
    installed, tmp_path, module, flags
):
    """mlx_lm.lora would fit the embedded default (a LLaDA) with the next-token loss; the start-up
    hook's guard on mlx-lm's trainer stops it before the first step and names `mlx_dllm lora`."""
    default = installed.site / "mlx_dllm_models" / "assets" / "default"
    adapters = tmp_path / "adapters"
    proc = _mlx_lm_lora(installed, module, default, _lora_data(tmp_path / "data"), adapters, *flags)
    assert proc.returncode != 0, proc.stdout
    error = "mlx_dllm_models.models.common.NotAutoregressiveError: llada is a diffusion model"
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith(error)] or [proc.stderr]
    assert line.startswith(error) and "`mlx_dllm lora" in line, proc.stderr[-2000:]
    assert not (adapters / "adapters.safetensors").exists()


def _tiny_llama(path):
    """A plain mlx-lm llama checkpoint (no diffusion), with the default's byte-level tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path.mkdir()
    config = dict(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=264,
        tie_word_embeddings=True,
    )
    (path / "config.json").write_text(json.dumps(config))
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    default = ROOT / "mlx_dllm_models" / "assets" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default / name, path / name)
    return path


def _nemotron(path):
    from tests.fixtures.nemotron import build

    return build(path)


@pytest.mark.parametrize("build", [_tiny_llama, _nemotron], ids=["llama", "nemotron"])
def test_mlx_lm_lora_still_trains_autoregressive_models(installed, tmp_path, build):
    """The guard leaves mlx-lm's own models alone, and Nemotron-Labs-Diffusion, which is also an
    autoregressive model (mlx-lm's generate runs it): the next-token loss trains that mode."""
    model = build(tmp_path / "model")
    adapters = tmp_path / "adapters"
    data = _lora_data(tmp_path / "data")
    proc = _mlx_lm_lora(
        installed, ["mlx_lm", "lora"], model, data, adapters, "--train", "--iters", "1"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (adapters / "adapters.safetensors").exists()
