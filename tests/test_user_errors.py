"""Reliability (issue 11): careless or hostile input gets the package's own error (SettingsError or
CheckpointError, both ValueError) with a message that says what is wrong and what to do; work is
bounded by the block, not by the settings; a failed conversion leaves nothing behind.

Each case failed before the change (a bare TypeError, garbage output, gigabytes allocated, a
traceback, a partial output folder)."""

import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from fixtures import all_checkpoints
from helpers import checkpoint_copy, checkpoint_fixtures, cli_env, edit_json, run_cli
from mlx_dllm_models import (
    CheckpointError,
    SettingsError,
    batch_generate_diffusion,
    generate_diffusion,
    load,
)
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.decoding import dream as dream_rules
from mlx_dllm_models.engine import make_decoder
from mlx_dllm_models.settings import resolve_settings
from mlx_dllm_models.settings_fields import ResolvedSettings
from mlx_dllm_models.tiny import build_tiny_llada

ROOT = Path(__file__).resolve().parents[1]
BUILDERS = all_checkpoints()

ckpt, loaded = checkpoint_fixtures("tiny_llada", build_tiny_llada)


# ------------------------------------------------------------------------------ careless input


@pytest.mark.parametrize(
    "prompts, pattern",
    [
        ("hello", "prompts must be a list of prompts.*got str"),
        (b"hello", "prompts must be a list of prompts.*got bytes"),
        ([[10, 11], "hi", [10.7]], "token ids must be integers, got 10.7"),
        ([[True, 10]], "token ids must be integers, got True"),
    ],
)
def test_batch_input(loaded, prompts, pattern):
    model, tok = loaded
    with pytest.raises(SettingsError, match=pattern):
        batch_generate_diffusion(model, tok, prompts, max_tokens=4)


@pytest.mark.parametrize(
    "prompt, pattern",
    [
        (b"hello", "the prompt is bytes"),
        ([10.7, 11], "token ids must be integers, got 10.7"),
        ([True], "token ids must be integers, got True"),
        (np.array([10.0, 11.0]), "token ids must be integers, got 10.0"),
        (None, "a prompt is text \\(str\\) or a list of token ids, got NoneType"),
        (12, "a prompt is text \\(str\\) or a list of token ids, got int"),
        ("a\ud800b", "not valid Unicode text.*position 1"),
        ([10, -1], "outside the vocabulary"),
    ],
)
def test_prompt_input(loaded, prompt, pattern):
    model, tok = loaded
    with pytest.raises(SettingsError, match=pattern):
        generate_diffusion(model, tok, prompt, max_tokens=4)


def test_integer_arrays_are_token_ids(loaded):
    model, tok = loaded
    want = generate_diffusion(model, tok, [10, 11, 12], max_tokens=4)
    assert generate_diffusion(model, tok, np.array([10, 11, 12]), max_tokens=4) == want
    assert generate_diffusion(model, tok, mx.array([10, 11, 12]), max_tokens=4) == want


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(temperature=True), "temperature must be"),
        (dict(sampler="threshold", threshold=True), "threshold must be in"),
        (dict(seed=-1), "seed must be an integer in \\[0, 2\\*\\*64\\)"),
        (dict(seed=2**64), "seed must be an integer in \\[0, 2\\*\\*64\\)"),
        (dict(seed=1.5), "seed must be an integer"),
    ],
)
def test_bad_values(loaded, kw, pattern):
    model, tok = loaded
    with pytest.raises(SettingsError, match=pattern):
        generate_diffusion(model, tok, [10, 11], max_tokens=4, **kw)


def test_largest_seed_runs(loaded):
    model, tok = loaded
    kw = dict(max_tokens=4, seed=2**64 - 1, temperature=1.0)
    # The seed is taken as given: two runs with it draw alike.
    assert generate_diffusion(model, tok, [10, 11], **kw) == generate_diffusion(
        model, tok, [10, 11], **kw
    )


def test_setting_from_generation_config_names_the_file(loaded):
    model, tok = loaded
    saved = model.generation_config
    want = generate_diffusion(model, tok, [10, 11], max_tokens=4, block_length=4)
    model.generation_config = {**saved, "block_length": 0}
    try:
        with pytest.raises(SettingsError, match="block_length.*comes from the checkpoint's "):
            generate_diffusion(model, tok, [10, 11], max_tokens=4)
        # Passed explicitly, the same bad value is the user's, and the override wins when good.
        with pytest.raises(SettingsError) as e:
            generate_diffusion(model, tok, [10, 11], max_tokens=4, block_length=0)
        assert "generation_config.json" not in str(e.value)
        assert generate_diffusion(model, tok, [10, 11], max_tokens=4, block_length=4) == want
    finally:
        model.generation_config = saved


# ------------------------------------------------------------------------------ checkpoints


def test_file_instead_of_folder(ckpt):
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        load(ckpt / "config.json")


def test_no_context_field_is_bounded(ckpt, tmp_path):
    path = checkpoint_copy(ckpt, tmp_path)
    edit_json(path, lambda c: c.pop("max_sequence_length"))
    model, tok = load(path)
    assert model.diffusion_spec.max_position_embeddings is None
    with pytest.raises(SettingsError, match="states no context length"):
        generate_diffusion(model, tok, [10, 11], max_tokens=10**12)


def test_sdar_load_shows_no_rope_scaling_warning(tmp_path):
    path = BUILDERS["sdar"](tmp_path / "sdar")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load(path)
    assert not [w for w in seen if "rope_scaling" in str(w.message)]


# ------------------------------------------------------------------------------ corrupt weights


def _poisoned(model):
    model.update(tree_map(lambda p: p * float("nan"), model.parameters()))


@pytest.mark.parametrize(
    "name, kw",
    [
        ("llada", {}),  # masked decoding, full recompute
        ("sdar", {}),  # masked decoding, block prefix cache
        ("nemotron", {"mode": "self_spec"}),  # self-speculation
    ],
)
def test_nan_weights_name_the_checkpoint(tmp_path, name, kw):
    path = BUILDERS[name](tmp_path / name)
    model, tok = load(path)
    _poisoned(model)
    with pytest.raises(CheckpointError, match=f"{name}.* NaN or infinite logits.*re-download"):
        generate_diffusion(model, tok, [10, 11], max_tokens=4, **kw)


def test_nan_weights_canvas_decoder(monkeypatch, loaded):
    """The canvas decoder (DiffusionGemma) checks its first forward too; its model's decode is
    replaced by one that returns NaN, without building the (slow) DiffusionGemma fixture."""
    from mlx_dllm_models.engine import canvas

    calls = []

    class Model:
        checkpoint_path = "/somewhere/dg"

        def decode(self, canvas_ids, *args, **kwargs):
            calls.append(1)
            return mx.full(canvas_ids.shape + (8,), float("nan"))

    decoder = canvas.CanvasDecoder.__new__(canvas.CanvasDecoder)
    decoder.model, decoder.nfe = Model(), 0
    decoder.rules = {}  # no structured-output constraint (run() sets it)
    decoder.s = ResolvedSettings.from_dict(
        dict(
            max_denoising_steps=4,
            sampler="entropy",
            t_min=0.1,
            t_max=1.0,
            entropy_bound=0.1,
            stability_threshold=2,
            confidence_threshold=0.1,
        )
    )
    decoder.spec = type("Spec", (), {"vocab_size": 8})()
    decoder.noise = type(
        "Noise", (), {"ids": staticmethod(lambda r, n, v: mx.zeros((1, n), mx.int32))}
    )
    with pytest.raises(CheckpointError, match="/somewhere/dg gave NaN"):
        rows = canvas._Rows([0], None, None, mx.zeros((1, 0), mx.int32))
        list(decoder._denoise(rows, 4, frozenset()))
    assert calls == [1]


# ------------------------------------------------------------------------------ bounded work


def test_steps_beyond_the_masks_cost_nothing(loaded):
    """steps=10**7 decodes as steps=block_length does (one token a step, then nothing): same
    tokens, same forwards, and no (B, steps) schedule in memory (40 MB of int32 before)."""
    model, tok = loaded
    kw = dict(max_tokens=8, block_length=8)
    generate_diffusion(model, tok, [10, 11], **kw, steps=8)  # warm-up
    mx.reset_peak_memory()
    want = list(_run(model, tok, kw, steps=8))
    base_peak = mx.get_peak_memory()
    mx.reset_peak_memory()
    got = list(_run(model, tok, kw, steps=10**7))
    assert got[0] == want[0] and got[1] == want[1] == 8
    assert mx.get_peak_memory() <= base_peak + (1 << 20)


def _run(model, tok, kw, **more):
    from mlx_dllm_models.generate import stream_events

    s, ids, decoder = stream_events(model, tok, [[10, 11]], **kw, **more)
    tokens = [t for e in decoder.run(ids) if hasattr(e, "finished") for t in e.tokens[0]]
    return tokens, decoder.nfe


def test_dream_schedule_beyond_its_steps_is_one_step():
    """Ranked algorithms at a huge `steps`: every count but the last is 0 (checked against the
    exact loop at 20000 steps), so the schedule is that one step, whatever `steps` is."""
    settings = ResolvedSettings.from_dict({"alg": "maskgit_plus", "eps": 1e-3})
    ratio = dream_rules._transfer_ratios(20000, 1e-3)
    assert not (np.float32(8) * ratio[:-1] >= 1).any()
    for steps in (20000, 10**9):
        sched = np.array(dream_rules.dream_schedule(mx.array([8, 3]), steps, settings))
        assert sched.tolist() == [[8], [3]]
    # Below the bound the exact per-step schedule is kept.
    exact = np.array(dream_rules.dream_schedule(mx.array([8]), 16, settings))
    assert exact.shape == (1, 16) and exact.sum() == 8
    # The one-per-step ratio of origin is the array's, without the array.
    for i in (0, 7, 15):
        assert dream_rules._transfer_ratio(i, 16, 1e-3) == dream_rules._transfer_ratios(16, 1e-3)[i]


def test_dream_origin_refuses_a_runaway_step_count():
    with pytest.raises(SettingsError, match="alg='origin' runs one forward per step"):
        dream_rules.dream_schedule(
            mx.array([8]), 10**9, ResolvedSettings.from_dict({"alg": "origin", "eps": 1e-3})
        )


def test_editing_stops_when_it_revisits_a_state(tmp_path):
    """LLaDA2.1 editing whose edits flip-flop (a model that proposes 6 over 5 and 5 over 6, both
    confidently) stops once a row's maskless block comes back to a state it held, instead of
    running all max_post_steps forwards."""
    model, _ = load(BUILDERS["llada2_moe"](tmp_path / "llada2"))
    spec = model.diffusion_spec
    vocab = model.args.vocab_size

    class FlipFlop:
        diffusion_spec, layers, args = spec, model.layers, model.args

        def __call__(self, x, cache=None, mask=None, head_span=None):
            span = x[:, head_span[0] : head_span[1]]
            propose = mx.where(span == 5, 6, 5)
            return 30.0 * (mx.arange(vocab) == propose[..., None]).astype(mx.float32)

    s = resolve_settings(
        spec,
        dict(
            max_tokens=4,
            block_length=4,
            steps=4,
            cache="none",
            editing_threshold=0.5,
            max_post_steps=1000,
        ),
    )
    decoder = make_decoder(FlipFlop(), s, [])
    events = list(decoder.run([[10, 11, 12, 13]]))
    assert events[-1].tokens[0] and set(events[-1].tokens[0]) <= {5, 6}
    # 4 steps for the masks, then A -> B -> A: far below the 1004 forwards of the budget.
    assert decoder.nfe <= 8


# ------------------------------------------------------------------------------ the CLI


def test_cli_unknown_command_prints_usage_to_stderr(capsys):
    assert cli_main(["bogus"]) == 2
    out = capsys.readouterr()
    assert "usage: mlx_dllm" in out.err and out.out == ""


def test_cli_corrupt_weights_is_one_line(monkeypatch, capsys, tmp_path, ckpt):
    """A corrupt checkpoint is only found at the first forward (a CheckpointError from the
    engine): one line on stderr, exit status 1, no traceback."""
    from safetensors.numpy import load_file, save_file

    path = checkpoint_copy(ckpt, tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    save_file(
        {k: v * np.float32("nan") for k, v in weights.items()}, str(path / "model.safetensors")
    )
    code = cli_main(["generate", "--model", str(path), "--prompt", "hi", "--no-live"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and "NaN or infinite logits" in err
    assert err.count("\n") == 1


@pytest.mark.slow
def test_cli_bad_seed_is_one_line(ckpt):
    out = run_cli("generate", "--model", str(ckpt), "--prompt", "hi", "--seed", "-1", "--no-live")
    assert out.returncode != 0
    assert out.stderr.strip().startswith("error: seed must be an integer in [0, 2**64)")
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_cli_broken_pipe(ckpt):
    """`mlx_dllm generate ... | head -c 1`: the reader leaves early; no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dllm_models", "generate", "--model", str(ckpt)]
        + ["--prompt", "hi", "--max-tokens", "64", "--block-length", "8", "--no-live"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        cwd=ROOT,
    )
    proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err.strip().splitlines() == [
        "error: the output was closed before generation ended (broken pipe)"
    ]
    assert proc.returncode != 0


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["-q", "--q-bits", "7"], "--q-bits 7 is not supported by mlx; choose one of 1, 2, 3, 4"),
        (["-q", "--q-bits", "0"], "--q-bits 0 is not supported"),
        (["-q", "--q-group-size", "7"], "--q-group-size 7 .*choose one of 32, 64, 128"),
        (["-q", "--q-group-size", "-64"], "--q-group-size -64 is not supported"),
        (["--q-bits", "4"], "only act with -q"),
    ],
)
def test_convert_rejects_bad_quantization_up_front(ckpt, tmp_path, flags, pattern):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=pattern):
        cli_main(["convert", "--hf-path", str(ckpt), "--mlx-path", str(out), *flags])
    assert list(tmp_path.iterdir()) == []


def test_convert_existing_output(ckpt, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit, match="out already exists; remove it or choose another"):
        cli_main(["convert", "--hf-path", str(ckpt), "--mlx-path", str(tmp_path / "out")])


def test_failed_convert_leaves_nothing(ckpt, tmp_path, monkeypatch):
    """A conversion that fails after writing (here: the model card step raises, as an interrupt
    would) removes its temporary folder; the target never appears; a re-run then succeeds."""
    from mlx_dllm_models import conversion

    out = tmp_path / "out"

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "finish_conversion", fail)
    assert cli_main(["convert", "--hf-path", str(ckpt), "--mlx-path", str(out)]) == 130
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert cli_main(["convert", "--hf-path", str(ckpt), "--mlx-path", str(out)]) == 0
    assert (out / "config.json").exists() and [p.name for p in tmp_path.iterdir()] == ["out"]
    model, tok = load(out)
    want = generate_diffusion(*load(ckpt), [10, 11], max_tokens=4)
    assert generate_diffusion(model, tok, [10, 11], max_tokens=4) == want


@pytest.mark.parametrize("kw", [dict(sampler=[]), dict(sampler={}), dict(cache=[]), dict(cache=0)])
def test_unhashable_or_empty_names(loaded, kw):
    """A list as sampler used to raise a bare TypeError (hashed for its defaults), and an empty
    list or 0 as cache was read as "auto"."""
    model, tok = loaded
    with pytest.raises(SettingsError, match="sampler|cache"):
        generate_diffusion(model, tok, [10, 11], max_tokens=2, **kw)


def test_dream_huge_steps_is_one_forward(tmp_path):
    """Dream's ranked algorithms at steps=2**64: one forward (the step that commits), at once."""
    from mlx_dllm_models.generate import stream_events

    model, tok = load(BUILDERS["dream"](tmp_path / "dream"))
    s, ids, decoder = stream_events(model, tok, [[10, 11]], max_tokens=3, steps=2**64)
    events = list(decoder.run(ids))
    assert decoder.nfe == 1 and len(events[-1].tokens[0]) <= 3


def test_canvas_stability_threshold_is_not_an_allocation(tmp_path):
    """DiffusionGemma's argmax history was sized by stability_threshold: 10**9 crashed the
    process. A canvas cannot be stable for more steps than it runs, so the history is bounded."""
    model, tok = load(BUILDERS["diffusion_gemma"](tmp_path / "dg"))
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = generate_diffusion(
        model, tok, [10, 11], max_tokens=2, stability_threshold=10**9, max_denoising_steps=3
    )
    assert isinstance(out, str)
    assert mx.get_peak_memory() - before < 64 << 20


def test_integers_past_int64(loaded):
    """A float setting given an int past int64 reached mlx as a bare 'std::bad_cast'."""
    model, tok = loaded
    with pytest.raises(SettingsError, match="entropy_bound must be a number below 2\\*\\*63"):
        generate_diffusion(
            model, tok, [10, 11], max_tokens=2, sampler="entropy", entropy_bound=2**64
        )


@pytest.mark.parametrize("mode", [[], {}, 3])
def test_unhashable_preset(tmp_path, mode):
    model, tok = load(BUILDERS["llada2_moe"](tmp_path / "llada2"))
    with pytest.raises(SettingsError, match="editing_mode"):
        generate_diffusion(model, tok, [10, 11], max_tokens=2, editing_mode=mode)
