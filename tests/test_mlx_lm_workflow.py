"""The mlx-lm user's habits: Hugging Face repo ids resolved as mlx_lm.load resolves them, and the
model card and remote-code removal of `mlx_dllm convert` (its fresh-process checks, with mlx-lm's
own tools refusing diffusion checkpoints, are in test_packaging_fresh_convert.py and
test_packaging_mlx_lm_tools.py).

The Hub is never reached: a Hugging Face cache directory in the hub's own layout
(models--org--name/blobs, snapshots/<commit>/ symlinks, refs/main) holds the embedded default under
a repo id, and the processes run with HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at it.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlx_dllm_models.conversion import (
    drop_remote_code,
    model_card_text,
    remote_generate_params,
    write_model_card,
)
from mlx_dllm_models.default import default_checkpoint

ROOT = Path(__file__).resolve().parents[1]
REPO = "tiny-org/tiny-llada"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo_dir = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / COMMIT
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(Path(default_checkpoint()).iterdir()):
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return cache


def _run(args, cache, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


LOAD_BY_REPO_ID = """
import json, sys
from mlx_dllm_models import CheckpointError, load
repo, commit = sys.argv[1], sys.argv[2]
out = {}
model, tokenizer = load(repo)
out["main"] = type(model).__module__
model, tokenizer = load(repo, revision=commit)
out["commit"] = type(model).__module__
for name, kwargs in [("missing", {}), ("bad_revision", {"revision": "f" * 40})]:
    target = "tiny-org/not-cached" if name == "missing" else repo
    try:
        load(target, **kwargs)
        out[name] = None
    except CheckpointError as e:
        out[name] = str(e)
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow
def test_load_resolves_a_repo_id_from_the_hugging_face_cache_offline(hub_cache):
    proc = _run(["-c", LOAD_BY_REPO_ID, REPO, COMMIT], hub_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["main"] == got["commit"] == "mlx_dllm_models.models.llada"
    for name in ("missing", "bad_revision"):
        assert got[name] is not None, f"{name}: loaded"
        assert "not in the Hugging Face cache" in got[name] and "HF_HUB_OFFLINE=1" in got[name]
        assert str(hub_cache) in got[name]
    assert "tiny-org/not-cached" in got["missing"] and "f" * 40 in got["bad_revision"]


@pytest.mark.slow
def test_cli_generates_from_a_repo_id(hub_cache):
    proc = _run(
        ["-m", "mlx_dllm_models", "generate", "--model", REPO, "--no-live", "--max-tokens", "16"],
        hub_cache,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The embedded default answers its own default prompt ("What is 47+85?").
    assert "132" in proc.stdout.split("=" * 10)[0], proc.stdout


def test_a_missing_local_folder_is_not_looked_up_on_the_hub(tmp_path):
    from mlx_dllm_models import CheckpointError, load

    with pytest.raises(CheckpointError, match="no checkpoint at .*repo id"):
        load(tmp_path / "no-such-folder")


def test_drop_remote_code_and_model_card(tmp_path):
    out = tmp_path / "converted"
    out.mkdir()
    auto_map = {"AutoConfig": "configuration_dream.DreamConfig"}
    (out / "config.json").write_text(json.dumps({"model_type": "Dream", "auto_map": auto_map}))
    tokenizer_map = {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}
    (out / "tokenizer_config.json").write_text(json.dumps({"auto_map": tokenizer_map}))
    (out / "configuration_dream.py").write_text("")
    (out / "tokenization_dream.py").write_text("")
    (out / "README.md").write_text("---\nlibrary_name: mlx\ntags:\n- mlx\n---\n")

    removed = drop_remote_code(out)
    assert sorted(removed) == sorted(
        [
            "config.json:auto_map",
            "tokenizer_config.json:auto_map",
            "configuration_dream.py",
            "tokenization_dream.py",
        ]
    )
    assert json.loads((out / "config.json").read_text()) == {"model_type": "Dream"}
    assert not list(out.glob("*.py"))

    card = write_model_card(out, "Dream-org/Dream-v0-Instruct-7B").read_text()
    assert "base_model: Dream-org/Dream-v0-Instruct-7B" in card
    assert "mlx_dllm generate --model converted" in card and "refuse it" in card
    assert card.count("- mlx\n") == 1 and "- mlx-dllm-models" in card
    # Nemotron also runs as an AR model in mlx-lm: its card says so instead.
    nemotron = model_card_text(out, None, "nemotron_labs_diffusion")
    assert "also runs as an autoregressive model" in nemotron and "refuse" not in nemotron


def test_conversion_keeps_what_the_remote_generate_takes(tmp_path):
    """LLaDA2.1's config and tokenizer files are 2.0's byte for byte: the parameters of its remote
    code's generate (editing_threshold) tell it apart. The conversion drops the code (read with
    ast, never run) but records them in config.json, so the converted checkpoint keeps 2.1's
    Quality Mode defaults."""
    out = tmp_path / "converted"
    out.mkdir()
    auto_map = {"AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}
    config = {"model_type": "llada2_moe", "auto_map": auto_map}
    (out / "config.json").write_text(json.dumps(config))
    (out / "modeling_llada2_moe.py").write_text(
        "raise SystemExit('the remote code ran')\n"
        "class LLaDA2MoeModelLM:\n"
        "    def generate(self, inputs, threshold=0.95, editing_threshold=None):\n"
        "        pass\n"
    )
    before = remote_generate_params(out, config)
    assert before == {"self", "inputs", "threshold", "editing_threshold"}

    drop_remote_code(out)
    converted = json.loads((out / "config.json").read_text())
    assert "auto_map" not in converted and not list(out.glob("*.py"))
    assert remote_generate_params(out, converted) == before


# ------------------------------------------------------------------------ mlx_dllm lora / fuse


def _subtraction_rows(n, seed=0):
    import random

    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a - b >= 10:
            rows.append({"prompt": f"What is {a}-{b}?", "completion": str(a - b)})
    return rows


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A few LoRA steps on the embedded default from a completions jsonl, through the CLI's
    argument parsing (mlx_lm.lora's flags) and mlx-lm's trainer."""
    import mlx.core as mx

    from mlx_dllm_models import lora

    root = tmp_path_factory.mktemp("lora")
    data = root / "data"
    data.mkdir()
    rows = _subtraction_rows(24)
    for name, part in (("train", rows[:16]), ("valid", rows[16:])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    adapters = root / "adapters"
    args = lora.parse_args(
        ["--train", "--data", str(data), "--adapter-path", str(adapters), "--iters", "4"]
        + ["--batch-size", "4", "--num-layers", "2", "--learning-rate", "1e-2"]
        + ["--steps-per-eval", "1000", "--val-batches", "1", "--save-every", "1000"]
    )
    model, tokenizer = lora.run(args)
    ids = mx.array([tokenizer.encode("What is 83-27?")])
    return SimpleNamespace(
        adapters=adapters, model=model, tokenizer=tokenizer, ids=ids, logits=model(ids), root=root
    )


@pytest.mark.slow
def test_lora_writes_mlx_lm_adapter_files_that_load_back(lora_run):
    import mlx.core as mx

    from mlx_dllm_models import load

    config = json.loads((lora_run.adapters / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 2
    assert config["model"] == default_checkpoint()
    weights = mx.load(str(lora_run.adapters / "adapters.safetensors"))
    lora_b = [v for k, v in weights.items() if k.endswith("lora_b")]
    assert lora_b and all("layers" in k for k in weights)
    # mlx-lm's LoRA starts lora_b at zero: non-zero means the diffusion loss trained them.
    assert max(float(mx.abs(v).max()) for v in lora_b) > 0

    again, _ = load(default_checkpoint(), adapter_path=str(lora_run.adapters))
    base, _ = load(default_checkpoint())
    assert mx.allclose(again(lora_run.ids), lora_run.logits, atol=1e-5).item()
    assert not mx.allclose(base(lora_run.ids), lora_run.logits, atol=1e-3).item()


@pytest.mark.slow
def test_fuse_folds_the_adapters_into_a_checkpoint(lora_run):
    import mlx.core as mx

    from mlx_dllm_models import load
    from mlx_dllm_models.cli import main

    out = lora_run.root / "fused"
    argv = sys.argv
    try:
        main(
            ["fuse", "--model", default_checkpoint(), "--adapter-path", str(lora_run.adapters)]
            + ["--save-path", str(out)]
        )
    finally:
        sys.argv = argv
    fused, _ = load(out)
    assert not any("lora" in k for k, _ in fused.named_modules())
    assert mx.allclose(fused(lora_run.ids), lora_run.logits, atol=1e-4).item()
    assert "mlx_dllm generate --model fused" in (out / "README.md").read_text()


@pytest.fixture(scope="module")
def default_model():
    from mlx_dllm_models import load

    return load(default_checkpoint())[0]


def _loss_inputs(model, loss, batch, lengths, seed=0):
    """What `loss` (lora.sft_loss's form) feeds `model` for one mlx-lm batch: the noisy tokens, as
    a list of rows, and the loss's (value, ntoks)."""
    import mlx.core as mx

    seen = []
    real = type(model).__call__

    class Spy(type(model)):
        def __call__(self, inputs, *a, **k):
            seen.append(inputs)
            return real(self, inputs, *a, **k)

    model.__class__ = Spy
    try:
        mx.random.seed(seed)
        value, ntoks = loss(model, mx.array(batch), mx.array(lengths))
    finally:
        model.__class__ = type(model).__mro__[1]
    (noisy,) = seen
    return noisy.tolist(), (float(value), int(ntoks))


def test_sft_loss_keeps_the_prompt_and_pads_answers_with_eos(default_model):
    """mlx-lm's batch is zero-padded; the loss sees EOS past each row's length, never a masked
    prompt position, and masks part of the answer."""
    from mlx_dllm_models.lora import sft_loss

    spec = default_model.diffusion_spec
    batch = [[5, 6, 7, 8, 9, 10, 0, 0], [5, 6, 7, 8, 9, 10, 11, 12]]
    loss = sft_loss(spec)
    noisy, (value, ntoks) = _loss_inputs(default_model, loss, batch, [[3, 6], [2, 8]])
    assert noisy[0][:3] == [5, 6, 7] and noisy[1][:2] == [5, 6]
    assert all(t in (spec.eos_token_ids[0], spec.mask_token_id) for t in noisy[0][6:])
    assert any(t == spec.mask_token_id for row in noisy for t in row)
    assert ntoks == (8 - 3) + (8 - 2) and value > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lora_noise_flags_reach_the_loss(default_model, seed):
    """`mlx_dllm lora --mask-eps E` (with the default spread noise levels): every row's answer is
    masked at a rate of at least E, and the batch's rates fall one into each of B equal strata of
    [E, 1]. With LLaDA's settings (`--mask-eps 1e-3 --no-low-discrepancy`) some row of 8 falls
    below 0.3 or two share a stratum."""
    import mlx.core as mx

    from mlx_dllm_models.lora import parse_args, trainer_loss

    B, P, L = 8, 2, 402
    batch, lengths = [[5] * L] * B, [[P, L]] * B

    mask = default_model.diffusion_spec.mask_token_id

    class Recorder:
        """Stands in for the model (the noise is all this test reads): records its input."""

        diffusion_spec = default_model.diffusion_spec

        def __call__(self, inputs, mask=None):
            self.inputs = inputs
            return mx.zeros((*inputs.shape, 8))

    def rates(argv):
        args = parse_args(["--train", "--data", "unused"] + argv)
        model = Recorder()
        mx.random.seed(seed)
        trainer_loss(args, model, ())(model, mx.array(batch), mx.array(lengths))
        return sorted(sum(t == mask for t in row[P:]) / (L - P) for row in model.inputs.tolist())

    eps = 0.3
    spread = rates(["--mask-eps", str(eps)])
    for i, rate in enumerate(spread):
        lo, hi = eps + (1 - eps) * i / B, eps + (1 - eps) * (i + 1) / B
        assert lo - 0.07 <= rate <= hi + 0.07, (i, rate, spread)
    llada = rates(["--mask-eps", "1e-3", "--no-low-discrepancy"])
    strata = {int((r - 1e-3) / (1 - 1e-3) * B) for r in llada}
    assert llada[0] < eps or len(strata) < B, llada


# ---------------------------------------------------------------------------- mlx_dllm evaluate

MC_TASK = """
task: dllm_addition_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""

GEN_TASK = """
task: dllm_addition_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow
def test_evaluate_scores_local_lm_eval_tasks_on_the_default(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")
    from mlx_dllm_models.cli import main
    from mlx_dllm_models.default import held_out_problems

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    rows = []
    for i, (question, answer) in enumerate(held_out_problems(10)):
        a = int(answer)
        choices = [str(a), str(a + 10), str(a - 10), str(a + 1)]
        label = i % 4  # the right answer in every position
        choices[0], choices[label] = choices[label], choices[0]
        rows.append({"question": question, "answer": answer, "choices": choices, "label": label})
    data = tmp_path / "addition.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MC_TASK.format(data=data))
    (tasks / "gen.yaml").write_text(GEN_TASK.format(data=data))

    out = tmp_path / "results"
    main(
        ["evaluate", "--tasks", "dllm_addition_mc", "dllm_addition_gen"]
        + ["--include-path", str(tasks), "--output-dir", str(out)]
        + ["--mc-samples", "8", "--batch-size", "8", "--seed", "0"]
    )
    (result_file,) = out.iterdir()
    results = json.loads(result_file.read_text())
    assert results["dllm_addition_mc"]["acc,none"] >= 0.9, results
    assert results["dllm_addition_gen"]["exact_match,none"] >= 0.9, results


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "no/such/folder"], "--data no/such/folder: no such folder"),
        (["--mask-eps", "0"], "--mask-eps 0.0: the floor of the mask rate must be in (0, 1)"),
        (["--mask-eps", "1.5"], "--mask-eps 1.5: the floor of the mask rate must be in (0, 1)"),
    ],
)
def test_lora_bad_input_says_what_to_do(tmp_path, flags, message):
    from mlx_dllm_models.cli import main

    data = tmp_path / "data"
    data.mkdir()
    rows = _subtraction_rows(8)
    for name in ("train", "valid"):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["lora", "--train", "--data", str(data), "--adapter-path", str(tmp_path / "a")]
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(argv + flags)
