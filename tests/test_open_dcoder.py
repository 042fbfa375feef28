"""Open-dCoder (fredzzp/open-dcoder-0.5B, pengzhangzhi/Open-dLLM): the forward against transformers'
Qwen2 read bidirectionally, decoding against a transcription of `_mdm_sample`
(tests/reference/open_dcoder_torch.py: p2 and entropy), sample.py's recipe as the defaults, the
`mlx_dllm convert --model-type open_dcoder` path to plain `mlx_lm.load`, and the loader's pointer
to it for the checkpoint as published (model_type "qwen2")."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures.open_dcoder import ENDOFTEXT, MASK, build, build_converted
from fixtures.qwen_body import VOCAB
from helpers import ROOT, batch_equal_to_single_runs, checkpoint_fixtures, cli_env, decoded, run_cli
from helpers import random_prompt as prompt
from mlx_dllm_models import CheckpointError, SettingsError, batch_generate_diffusion, load
from mlx_dllm_models.conversion import retyped_config
from mlx_dllm_models.decoding import dream as dream_rules
from mlx_dllm_models.decoding import p2 as p2_rules
from mlx_dllm_models.decoding import stats as stats_module
from mlx_dllm_models.decoding.samplers import COMMIT_RULES
from mlx_dllm_models.engine import make_decoder
from mlx_dllm_models.models import open_dcoder
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import resolve_settings
from reference.open_dcoder_torch import mdm_sample, reference_logits

DATA = Path(__file__).parent / "data" / "fredzzp__open-dcoder-0.5B"


@pytest.fixture(scope="module")
def published(fixture_dir):
    return build_once(fixture_dir / "open_dcoder_published", build)


ckpt, loaded = checkpoint_fixtures("open_dcoder", build_converted)


# ------------------------------------------------------------------------------------ forward


def test_spec_and_defaults_are_sample_py_recipe(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert (spec.mask_token_id, spec.eos_token_ids, spec.confidence) == (
        MASK,
        (ENDOFTEXT,),
        "sampled",
    )
    s = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    # MDMGenerationConfig(max_new_tokens=128, steps=128, temperature=0.5, top_k=200, alg="p2",
    # alg_temp=0.5): one block over the canvas.
    want = dict(sampler="p2", max_tokens=128, steps=128, block_length=128, temperature=0.5)
    assert {k: getattr(s, k) for k in want} == want
    assert (s.top_k, s.top_p, s.alg_temp, s.alg, s.eps) == (
        200,
        None,
        0.5,
        "entropy",
        1e-3,
    )


# --------------------------------------------------------------------------------- decoding


def ours(model, prompts, **kw):
    spec = model.diffusion_spec
    settings = resolve_settings(spec, kw, checkpoint_settings(model, spec))
    decoder = make_decoder(model, settings, eos_token_ids=())
    return decoded(decoder, prompts)


def reference(ckpt, p, max_tokens, steps, **kw):
    forward = lambda x: reference_logits(ckpt, x)  # noqa: E731
    seq, nfe = mdm_sample(forward, np.array([p]), max_tokens, steps, mask_token_id=MASK, **kw)
    assert not (seq == MASK).any()
    return seq[0, len(p) :].tolist(), nfe


@pytest.mark.parametrize("case", [(6, 0, 12, 12), (3, 1, 16, 6), (9, 2, 10, 4)])
def test_p2_greedy_matches_the_reference(loaded, ckpt, monkeypatch, case):
    n, seed, max_tokens, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    want, ref_nfe = reference(ckpt, p, max_tokens, steps, alg="p2", top_k=200)
    got, nfe = ours(model, [p], max_tokens=max_tokens, steps=steps, temperature=0.0)
    assert got[0] == want and nfe == ref_nfe
    # Re-masking committed tokens matters: without it, other tokens.
    keep_all = p2_rules.p2_commit

    def never_reopen(stats, cand, ctx):
        commit, reopen = keep_all(stats, cand, ctx)
        return commit, mx.zeros_like(reopen)

    monkeypatch.setitem(COMMIT_RULES, "p2", replace(keep_all, commit=never_reopen))
    assert ours(model, [p], max_tokens=max_tokens, steps=steps, temperature=0.0)[0] != got


@pytest.mark.parametrize("case", [(6, 0, 12, 12), (4, 3, 16, 5)])
def test_entropy_greedy_matches_the_reference(loaded, ckpt, case):
    n, seed, max_tokens, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    want, _ = reference(ckpt, p, max_tokens, steps, alg="entropy", top_k=200)
    kw = dict(sampler="dream", alg="entropy", alg_temp=0.0, temperature=0.0)
    got, _ = ours(model, [p], max_tokens=max_tokens, steps=steps, **kw)
    assert got[0] == want


class _Draws:
    """One table of uniform draws (steps, N, V) for both sides. Ours: decoding.stats.uniform
    returns table[i] at its i-th call (the canvas's Gumbel-max sample at temperature > 0); the
    reference's Categorical(probs).sample() becomes argmax(log probs + G), the same distribution,
    with G = -log(-log u) on the canvas (the prompt's draws are never used: p2 fixes it)."""

    def __init__(self, steps, n_prompt, max_tokens, seed):
        u = np.random.default_rng(seed).random((steps, max_tokens, VOCAB))
        self.u = np.maximum(u, 1e-20).astype(np.float32)
        self.n_prompt, self.i, self.j = n_prompt, 0, 0

    def ours(self, key, shape, low=0.0):
        assert shape == (1, *self.u.shape[1:])
        self.i += 1
        return mx.array(self.u[self.i - 1][None])

    def reference(self, probs, step):
        assert step == self.j
        self.j += 1
        g = -np.log(-np.log(self.u[step].astype(np.float64))).astype(np.float32)
        g = np.concatenate([np.zeros((self.n_prompt, VOCAB), np.float32), g])
        return torch.argmax(torch.log(probs) + torch.from_numpy(g)[None], dim=-1)


@pytest.mark.parametrize("case", [(5, 4, 20, 20), (8, 6, 12, 5), (7, 3, 24, 8)])
def test_the_recipe_matches_the_reference_with_the_same_draws(loaded, ckpt, monkeypatch, case):
    """sample.py's recipe (p2, temperature 0.5, top-k 200) with the x0 draws replayed. At
    temperature 0.5 most confidences sit within 1e-6 of 1, so p2 ranks them as torch's softmax
    rounds them (TokenStats.softmax_confidence). Cases where probabilities of exactly 1.0 tie
    across the re-masking boundary are left out: torch.argsort orders ties as it likes."""
    n, seed, max_tokens, steps = case
    model, _ = loaded
    p = prompt(n, seed)
    draws = _Draws(steps, n, max_tokens, seed + 50)
    want, ref_nfe = reference(
        ckpt, p, max_tokens, steps, alg="p2", temperature=0.5, top_k=200, draw_x0=draws.reference
    )
    monkeypatch.setattr(stats_module, "uniform", draws.ours)
    got, nfe = ours(model, [p], max_tokens=max_tokens, steps=steps)
    assert got[0] == want and nfe == ref_nfe == draws.i == draws.j
    greedy, _ = reference(ckpt, p, max_tokens, steps, alg="p2", top_k=200)
    assert greedy != got[0]  # the draws matter


def test_alg_temp_ranking_matches_the_reference_with_the_same_noise(loaded, ckpt, monkeypatch):
    """Sampler "dream" (alg entropy, alg_temp 0.5): upstream's Gumbel top-k, the same noise."""
    n, max_tokens, steps = 5, 12, 6
    model, _ = loaded
    p = prompt(n, 8)
    u = np.random.default_rng(9).random((steps, max_tokens)).clip(1e-20, 1 - 1e-20)
    g = (-np.log(-np.log(u))).astype(np.float32)
    used = []

    def reference_noise(shape, step):
        used.append(step)
        return torch.from_numpy(np.concatenate([np.zeros((1, n), np.float32), g[step][None]], 1))

    want, _ = reference(
        ckpt, p, max_tokens, steps, alg="entropy", alg_temp=0.5, top_k=200, gumbel=reference_noise
    )
    calls = []

    def our_noise(key, shape):
        calls.append(None)
        return mx.array(g[used[len(calls) - 1]][None])

    monkeypatch.setattr(dream_rules, "_gumbel", our_noise)
    kw = dict(sampler="dream", alg="entropy", temperature=0.0)
    got, _ = ours(model, [p], max_tokens=max_tokens, steps=steps, **kw)
    assert got[0] == want and len(calls) == len(used)


def test_batch_rows_of_different_lengths_equal_single_runs(loaded):
    model, tok = loaded
    prompts = [prompt(9, 10), prompt(3, 11), prompt(14, 12)]
    # The recipe's sampling (temperature 0.5, top-k 200), and a hotter one where the draws show.
    for temperature in (0.5, 2.0):
        kw = dict(max_tokens=10, steps=5, temperature=temperature)
        batch = batch_equal_to_single_runs(model, tok, prompts, **kw)
    other = batch_generate_diffusion(model, tok, prompts, seed=7, **kw).tokens
    assert other != batch.tokens  # the draws matter


# ------------------------------------------------------------- convert, load, bad input


@pytest.mark.slow
def test_convert_with_model_type_then_plain_mlx_lm_load(loaded, published, tmp_path):
    model, tok = loaded
    out = tmp_path / "mlx"
    proc = run_cli(
        "convert",
        "--hf-path",
        str(published),
        "--mlx-path",
        str(out),
        "--model-type",
        "open_dcoder",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["mask_token_id"]) == ("open_dcoder", MASK)
    code = (
        "import sys, json; from mlx_lm import load;"
        "from mlx_dllm_models import batch_generate_diffusion as g;"
        "m, t = load(sys.argv[1]); print(type(m).__module__);"
        "print(json.dumps(g(m, t, [[40, 41, 42]], max_tokens=8, seed=1).tokens[0]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, tokens = proc.stdout.strip().splitlines()[-2:]
    assert module == "mlx_dllm_models.models.open_dcoder"
    want = batch_generate_diffusion(model, tok, [[40, 41, 42]], max_tokens=8, seed=1)
    assert json.loads(tokens) == want.tokens[0] and len(want.tokens[0]) > 0


def test_bad_input_is_a_one_line_error(published, ckpt, tmp_path):
    # The checkpoint as published: model_type qwen2 stays mlx-lm's; the loader points at convert.
    with pytest.raises(CheckpointError, match="--model-type open_dcoder") as e:
        load(published)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="not one this package writes"):
        retyped_config(published, "qwen2")
    cfg = json.loads((published / "config.json").read_text())
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="has model_type 'llama'"):
        retyped_config(other, "open_dcoder")
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    with pytest.raises(CheckpointError, match="names a mask token"):
        retyped_config(other, "open_dcoder")  # no tokenizer: no mask id


def test_p2_refuses_grammar_constraints(loaded):
    model, tok = loaded
    with pytest.raises(SettingsError, match="re-masks committed tokens"):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, regex="[a-z]+")


def test_published_config_builds_the_full_model_lazily():
    from mlx.utils import tree_flatten

    cfg = json.loads((DATA / "config.json").read_text())
    assert "mask_token_id" not in cfg and cfg["model_type"] == "qwen2"
    args = open_dcoder.ModelArgs.from_dict({**cfg, "model_type": "open_dcoder"})
    model = open_dcoder.Model(args)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 4.9e8 < count < 5.0e8  # Qwen2.5-Coder-0.5B: 494M, head tied
    spec = model.diffusion_spec
    assert (spec.mask_token_id, spec.eos_token_ids) == (151665, (151643,))
