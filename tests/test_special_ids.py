"""Special token ids in config.json are checked against the vocabulary when a checkpoint loads.

An out-of-range mask id used to load fine and then crash the process at generation (a Metal
out-of-bounds gather: segfault, heap corruption, or garbage for -1 / vocab_size). Every family's
fixture is written once, one id is corrupted in a copy, and `mlx_dllm_models.load` must raise a
ValueError that names the key and the vocabulary size. One case per family also runs load and a
short generation in a fresh process, so that a crash fails that test instead of killing pytest.
Also here: the cached diffusion_spec, and LLaDA's `to_hf_weights` (the inverse of `sanitize`).
"""

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fixtures import all_checkpoints, build_once
from fixtures.lumina_dimoo import VOCAB as LUMINA_DIMOO_VOCAB
from mlx_dllm_models import load

BUILDERS = all_checkpoints()
VOCAB = 320  # every fixture's vocabulary but those at their model's real ids:
REAL_ID_VOCABS = {"lumina_dimoo": LUMINA_DIMOO_VOCAB}

# (fixture, config key, bad value); a dotted key is nested (text_config.pad_token_id).
BAD_IDS = [
    ("llada", "mask_token_id", VOCAB),
    ("llada", "mask_token_id", -5),
    ("llada", "mask_token_id", 2**40),
    ("llada", "eos_token_id", [301, VOCAB]),
    ("llada", "pad_token_id", 400),
    ("llada", "bos_token_id", -7),
    ("llada_moe", "mask_token_id", VOCAB),
    ("llada_moe", "eos_token_id", -1),
    ("dream", "mask_token_id", VOCAB),
    ("dream", "mask_token_id", -5),
    ("dream", "pad_token_id", 1000),
    ("dream", "eos_token_id", VOCAB + 1),
    ("sdar", "mask_token_id", VOCAB),
    ("sdar", "eos_token_id", VOCAB),
    ("sdar", "pad_token_id", -2),
    ("sdar_moe", "mask_token_id", -5),
    ("llada2_moe", "mask_token_id", VOCAB),
    ("llada2_moe", "delete_token_id", VOCAB),
    ("llada2_moe", "split_token_id", -2),
    ("llada2_moe", "pad_token_id", 999),
    ("nemotron", "mask_token_id", VOCAB),
    ("nemotron", "mask_token_id", -5),
    ("nemotron", "eos_token_id", VOCAB + 1),
    ("nemotron", "pad_token_id", VOCAB),
    ("nemotron_tied", "mask_token_id", 2**31),
    ("diffusion_gemma", "image_token_id", VOCAB),
    ("diffusion_gemma", "boi_token_id", -1),
    ("diffusion_gemma", "eoi_token_id", 10**9),
    ("diffusion_gemma", "eos_token_id", [257, VOCAB]),
    ("diffusion_gemma", "text_config.pad_token_id", VOCAB),
    ("diffusion_gemma", "text_config.eos_token_id", 500),
]

# One case per model type, also run in a fresh process (load, then generate if load passes).
IN_SUBPROCESS = [
    ("llada", "mask_token_id", VOCAB),
    ("llada_moe", "mask_token_id", -5),
    ("dream", "mask_token_id", VOCAB),
    ("sdar", "mask_token_id", -5),
    ("sdar_moe", "mask_token_id", VOCAB),
    ("llada2_moe", "mask_token_id", VOCAB),
    ("nemotron", "mask_token_id", VOCAB),
    ("diffusion_gemma", "image_token_id", VOCAB),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("special_ids")


@pytest.fixture(scope="module")
def checkpoint(root):
    """name -> the fixture's checkpoint, written once for the module."""
    return lambda name: build_once(root / "clean" / name, BUILDERS[name])


def _set(cfg: dict, key: str, value):
    *parents, leaf = key.split(".")
    for p in parents:
        cfg = cfg[p]
    cfg[leaf] = value


def corrupted(checkpoint, root, name, key, value, tag="") -> Path:
    """A copy of the fixture with config.json's `key` set to `value`. EOS ids are also set in
    generation_config.json, whose eos_token_id mlx-lm reads over config.json's."""
    dst = root / f"{name}-{key}-{value}{tag}".replace("[", "").replace("]", "").replace(" ", "")
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(checkpoint(name), dst)
    for file in ("config.json", "generation_config.json"):
        path = dst / file
        if not path.exists() or (file != "config.json" and key != "eos_token_id"):
            continue
        cfg = json.loads(path.read_text())
        if file == "config.json" or "eos_token_id" in cfg:
            _set(cfg, key, value)
            path.write_text(json.dumps(cfg))
    return dst


def assert_names_key_and_vocab(message: str, key: str):
    assert key in message, message
    assert f"vocab_size {VOCAB}" in message, message
    assert "outside the vocabulary" in message, message


@pytest.mark.parametrize("name,key,value", BAD_IDS, ids=lambda v: str(v))
def test_out_of_range_id_is_a_clear_error_at_load(checkpoint, root, name, key, value):
    path = corrupted(checkpoint, root, name, key, value)
    with pytest.raises(ValueError) as err:
        load(path)
    assert_names_key_and_vocab(str(err.value), key)


_SCRIPT = textwrap.dedent(
    """
    import sys
    from mlx_dllm_models import generate_diffusion, load

    try:
        model, tok = load(sys.argv[1])
    except ValueError as e:
        print("ValueError:", e)
        sys.exit(3)
    # Before the check, this is where an out-of-range id crashed the process.
    print(generate_diffusion(model, tok, [10, 11, 12], max_tokens=8))
    """
)


@pytest.fixture(scope="module")
def fresh_processes(checkpoint, root):
    """All the fresh-process loads, started at once (they are mostly interpreter start-up)."""
    root_dir = Path(__file__).resolve().parents[1]
    procs = {}
    for name, key, value in IN_SUBPROCESS:
        path = corrupted(checkpoint, root, name, key, value, tag="-fresh")
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(path)],
            cwd=root_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("name,key,value", IN_SUBPROCESS, ids=lambda v: str(v))
def test_out_of_range_mask_fails_cleanly_in_a_fresh_process(fresh_processes, name, key, value):
    proc = fresh_processes[name]
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}:\n{out}"
    assert proc.returncode == 3, f"load did not raise a ValueError (exit {proc.returncode}):\n{out}"
    assert_names_key_and_vocab(out, key)


# ------------------------------------------------------------------------------- valid configs


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fixtures_load(checkpoint, name):
    model, _ = load(checkpoint(name))
    spec = model.diffusion_spec
    vocab = REAL_ID_VOCABS.get(name, VOCAB)
    assert all(0 <= e < vocab for e in spec.eos_token_ids)
    assert spec.mask_token_id is None or 0 <= spec.mask_token_id < vocab


@pytest.mark.parametrize(
    "name,key,value",
    [
        ("llada", "pad_token_id", -1),
        ("llada", "pad_token_id", None),
        ("llada", "bos_token_id", -1),
        ("dream", "bos_token_id", None),
        ("sdar", "pad_token_id", -1),
        ("llada2_moe", "delete_token_id", None),
        ("nemotron", "pad_token_id", -1),
        ("diffusion_gemma", "boi_token_id", None),
        ("diffusion_gemma", "text_config.pad_token_id", -1),
    ],
    ids=lambda v: str(v),
)
def test_none_values_are_accepted(checkpoint, root, name, key, value):
    load(corrupted(checkpoint, root, name, key, value))


@pytest.mark.parametrize("value", [None, -1])
def test_nemotron_without_mask_id_loads_for_ar_use(checkpoint, root, value):
    model, _ = load(corrupted(checkpoint, root, "nemotron", "mask_token_id", value))
    assert model.args.mask_token_id is None
    assert model(mx.array([[10, 11]]), mask="causal").shape == (1, 2, VOCAB)
    with pytest.raises(ValueError, match="mask_token_id"):
        model.diffusion_spec


def test_llada2_eos_defaults_to_pad(checkpoint, root):
    path = corrupted(checkpoint, root, "llada2_moe", "eos_token_id", None)
    gen = path / "generation_config.json"
    if gen.exists():
        cfg = json.loads(gen.read_text())
        cfg.pop("eos_token_id", None)
        gen.write_text(json.dumps(cfg))
    model, _ = load(path)
    pad = json.loads((path / "config.json").read_text())["pad_token_id"]
    assert model.diffusion_spec.eos_token_ids == (pad,)


# --------------------------------------------------------------------------------- cached spec


def test_spec_is_built_once_and_can_be_replaced(checkpoint):
    model, _ = load(checkpoint("llada"))
    params = sorted(k for k, _ in tree_flatten(model.parameters()))
    spec = model.diffusion_spec
    assert model.diffusion_spec is spec
    model.diffusion_spec = dataclasses.replace(spec, eos_token_ids=(7,))
    assert model.diffusion_spec.eos_token_ids == (7,)
    # The cached spec is not a parameter: the tree and a save / load round trip are unchanged.
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == params
    assert "_diffusion_spec" not in model and "diffusion_spec" not in model


def test_spec_follows_a_changed_config(checkpoint):
    model, _ = load(checkpoint("llada"))
    first = model.diffusion_spec
    model.args.eos_token_id = [5, 6]
    assert model.diffusion_spec.eos_token_ids == (5, 6)
    assert model.diffusion_spec is not first


def test_weights_save_and_load_with_a_cached_spec(checkpoint, tmp_path):
    model, _ = load(checkpoint("sdar"))
    model.diffusion_spec  # cached
    model.save_weights(str(tmp_path / "w.safetensors"))
    saved = mx.load(str(tmp_path / "w.safetensors"))
    assert set(saved) == {k for k, _ in tree_flatten(model.parameters())}
    model.load_weights(str(tmp_path / "w.safetensors"), strict=True)


# ------------------------------------------------------------------------------ to_hf_weights


@pytest.mark.parametrize("name", ["llada", "llada_moe"])
def test_llada_to_hf_weights_inverts_sanitize(checkpoint, name):
    path = checkpoint(name)
    model, _ = load(path)
    ours = dict(tree_flatten(model.parameters()))
    hf = model.to_hf_weights(ours)
    back = model.sanitize(dict(hf))
    assert set(back) == set(ours)
    for k in ours:
        assert np.array_equal(np.array(back[k]), np.array(ours[k])), k
    if name == "llada":
        # The dense names are LLaDA 8B's own: exactly the checkpoint's.
        original = {}
        for f in path.glob("*.safetensors"):
            original.update(mx.load(str(f)))
        assert set(hf) == set(original)
