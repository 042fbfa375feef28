"""WeDLM (tencent/WeDLM-7B / -8B, model_type "wedlm"): the forward against transformers' Qwen2 /
Qwen3 under causal attention over the reordered window, the `wedlm` decoder against a
transcription of the reference engine's decoding (tests/reference/wedlm_torch.py), its rule, the
recipe, plain `mlx_lm convert` / `mlx_lm.load`, batches (rows stepping together), sharding over
one process and serve."""

import importlib
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures.wedlm import IM_END, MASK, build, build_qwen2
from helpers import (
    assert_close,
    batch_equal_to_single_runs,
    checkpoint_fixtures,
    decoded,
    far,
    load_fixture,
)
from helpers import random_prompt as prompt
from mlx_dllm_models import SettingsError, batch_generate_diffusion
from mlx_dllm_models.decoding.wedlm import reordered_causal_mask, wedlm_commit
from mlx_dllm_models.engine import BlockEvent, make_decoder
from mlx_dllm_models.models import wedlm
from mlx_dllm_models.registry import MODEL_TYPES
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import resolve_settings
from reference import wedlm_torch as ref

DATA = Path(__file__).parent / "data" / "tencent__WeDLM-8B-Instruct"
BUILDERS = {"qwen3": build, "qwen2": build_qwen2}


ckpt, loaded = checkpoint_fixtures("wedlm", BUILDERS)


# ------------------------------------------------------------------------------------ forward


def test_causal_logits_match_transformers_qwen(ckpt):
    model, _ = load_fixture(ckpt)
    ids = [prompt(11, 1)]
    ours = model(mx.array(ids), mask="causal")
    assert_close(ours, ref.reference_logits(ckpt, ids))
    assert_close(model(mx.array(ids), mask="causal", head_span=(4, 9)), np.array(ours)[:, 4:9])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_mask_is_causal_attention_over_the_reordered_window(ckpt, seed):
    """The reference permutes the window (filled first) and runs causal attention with the
    original positions; the package keeps it in place under reordered_causal_mask."""
    model, _ = load_fixture(ckpt)
    rng = np.random.default_rng(seed)
    context = prompt(7, seed)
    window = rng.integers(0, 256, 12)
    window[rng.random(12) < 0.5] = MASK
    window[0] = MASK  # a window always starts with masks after its prefix has left
    ids = context + window.tolist()
    filled = [True] * len(context) + [t != MASK for t in window]
    ours = np.array(model(mx.array([ids]), mask=reordered_causal_mask(filled)))[0]
    order = [i for i, f in enumerate(filled) if f] + [i for i, f in enumerate(filled) if not f]
    want = ref.reference_logits(ckpt, [[ids[i] for i in order]], [order])[0]
    assert_close(ours[order], want)
    # Plain causal attention over the window in place is another reading: a mask would no
    # longer see the filled positions after it.
    plain = np.array(model(mx.array([ids]), mask="causal"))[0]
    assert far(plain[order], want)


def test_reordered_mask_by_hand():
    f = [True, True, False, True, False]
    keep = np.array(reordered_causal_mask(f))
    want = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0],  # a mask sees every filled position, after it too
            [1, 1, 0, 1, 0],  # a filled position never sees a mask
            [1, 1, 1, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(keep, want)
    # A forward's rows only (a step over the columns after the committed ones).
    np.testing.assert_array_equal(np.array(reordered_causal_mask(f, 2)), want[2:])


# --------------------------------------------------------------------------- spec and settings


def test_spec_and_defaults_are_the_reference_engines_recipe(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert (spec.decoder, spec.samplers) == ("wedlm", ("wedlm",))
    s = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    got = {k: getattr(s, k) for k in wedlm.WEDLM_DEFAULTS}
    assert got == {
        "sampler": "wedlm",
        "block_length": 16,
        "entropy_threshold": 0.4,
        "pos_penalty_factor": 0.02,
        "temperature": 0.0,
        "top_p": None,
        "top_k": None,
        "max_tokens": 512,
    }
    assert s.cache == "auto"


def test_a_generation_config_is_not_read(loaded):
    """The reference engine takes its values from SamplingParams only."""
    model, _ = loaded
    model.generation_config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 9}
    try:
        assert checkpoint_settings(model, model.diffusion_spec) == {}
    finally:
        model.generation_config = {}


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"steps": 4}, "steps does not apply to the wedlm family: a step fills every mask"),
        ({"threshold": 0.9}, "threshold does not apply to the wedlm family"),
        ({"entropy_threshold": -0.1}, "entropy_threshold"),
        ({"pos_penalty_factor": -1.0}, "pos_penalty_factor"),
        ({"block_length": 0}, "block_length"),
        ({"sampler": "quota"}, "unknown sampler 'quota' for the wedlm family"),
        ({"cache": "dual"}, "cache='dual' is not available for the wedlm family"),
        ({"alg": "entropy"}, "alg is a setting of the dream / coda / open_dcoder family"),
    ],
)
def test_bad_settings_are_clear_errors(loaded, kw, match):
    model, tok = loaded
    with pytest.raises(SettingsError, match=match):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, **kw)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"attention_bias": True, "qk_norm": True}, "attention_bias=True and qk_norm=True"),
        ({"attention_bias": False, "qk_norm": False}, "attention_bias=False and qk_norm=False"),
        ({"attention_bias": True, "qk_norm": False, "head_dim": 32}, "head_dim = hidden_size"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"mask_token_id": 100000}, "mask_token_id 100000 is outside the vocabulary"),
    ],
)
def test_bad_configs_are_clear_errors(change, match):
    from fixtures.wedlm import config

    with pytest.raises(ValueError, match=match):
        wedlm.ModelArgs.from_dict({**config(), **change})


def test_plain_qwen_checkpoints_stay_mlx_lms():
    """Only model_type "wedlm" is ours: a Qwen2 / Qwen3 checkpoint loads mlx-lm's own module."""
    assert "wedlm" in MODEL_TYPES and not {"qwen2", "qwen3"} & set(MODEL_TYPES)
    for name in ("qwen2", "qwen3"):
        module = importlib.import_module(f"mlx_lm.models.{name}")
        assert module.__name__ == f"mlx_lm.models.{name}" and "mlx_lm" in module.__file__


# ------------------------------------------------------------------------------------- the rule


def _select_reference(entropy, remaining, threshold, penalty):
    return ref.select_positions_to_fill(torch.tensor(entropy), remaining, threshold, penalty)


@pytest.mark.parametrize("seed", range(6))
def test_rule_matches_select_positions_to_fill(seed):
    rng = np.random.default_rng(seed)
    width = 12
    masked = rng.random(width) < 0.6
    masked[rng.integers(width)] = True
    entropy = (rng.random(width) * 1.5).astype(np.float32)
    remaining = [int(i) for i in np.flatnonzero(masked)]
    for threshold in (None, 0.2, 0.4, 0.8, 5.0):
        for penalty in (0.0, 0.02, 0.3):
            got = wedlm_commit(mx.array(entropy[None]), mx.array(masked[None]), threshold, penalty)
            picked = [
                remaining[k]
                for k in _select_reference(entropy[masked], remaining, threshold, penalty)
            ]
            assert np.flatnonzero(np.array(got[0])).tolist() == picked


def test_rule_threshold_zero_is_one_mask_a_step():
    entropy = mx.array([[0.0, 0.0, 0.5, 0.0]])
    masked = mx.array([[False, True, True, True]])
    # 0 is never strictly above an entropy: the least adjusted one alone, as the reference's None.
    assert np.array(wedlm_commit(entropy, masked, 0.0, 0.02)).tolist() == [
        [False, True, False, False]
    ]
    assert np.array(wedlm_commit(entropy, masked, None, 0.02)).tolist() == [
        [False, True, False, False]
    ]
    # The penalty counts window columns from the first mask: at 0.3 the last mask (0.6) loses.
    both = np.array(wedlm_commit(entropy, masked, 0.5, 0.3)).tolist()
    assert both == [[False, True, False, False]]
    assert np.array(wedlm_commit(entropy, masked, 0.7, 0.3)).tolist() == [
        [False, True, False, True]
    ]


# --------------------------------------------------------------------------------- decoding


def ours(model, prompts, eos=(IM_END,), **kw):
    spec = model.diffusion_spec
    settings = resolve_settings(spec, kw, {})
    decoder = make_decoder(model, settings, eos_token_ids=eos)
    return decoded(decoder, prompts)


def reference(ckpt, p, max_tokens, eos=(IM_END,), **kw):
    threshold = kw.get("entropy_threshold", 0.4)
    return ref.generate(
        ckpt,
        p,
        max_tokens,
        MASK,
        window_size=kw.get("block_length", 16),
        entropy_threshold=threshold if threshold else None,  # our 0 is the reference's None
        pos_penalty_factor=kw.get("pos_penalty_factor", 0.02),
        temperature=kw.get("temperature", 0.0),
        top_p=kw.get("top_p") or 1.0,
        top_k=kw.get("top_k") or 0,
        stop_token_ids=eos,
    )


CASES = [
    {},  # the recipe: window 16, threshold 0.4, penalty 0.02
    {"entropy_threshold": 0.0},  # one mask a step (the reference's None)
    {"entropy_threshold": 2.0, "block_length": 4},
    {"entropy_threshold": 1.0, "pos_penalty_factor": 0.5},
    {"entropy_threshold": 0.8, "pos_penalty_factor": 0.0, "block_length": 7},
    {"block_length": 1},  # one mask: left-to-right decoding
]


@pytest.mark.parametrize("cache", ["prefix", "none"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_tokens_and_forwards_match_the_reference(loaded, ckpt, case, cache):
    model, _ = loaded
    kw = CASES[case]
    p = prompt(5 + case, case)
    want, forwards = reference(ckpt, p, 30, **kw)
    (got,), nfe = ours(model, [p], max_tokens=30, cache=cache, **kw)
    assert got == want and len(got) == 30
    # The reference's prefill forward is folded into the first step here.
    assert nfe == forwards


def test_parallel_steps_take_fewer_forwards(loaded):
    model, _ = loaded
    p = prompt(6, 3)
    (_,), one = ours(model, [p], max_tokens=30, entropy_threshold=0.0)
    (_,), many = ours(model, [p], max_tokens=30, entropy_threshold=2.0)
    assert one >= 30 and many < one / 2


def test_a_stop_token_ends_the_row_as_in_the_reference(loaded, ckpt):
    model, _ = loaded
    p = prompt(6, 4)
    (full,), _ = ours(model, [p], max_tokens=30)
    stop = full[12]
    want, forwards = reference(ckpt, p, 30, eos=(stop,))
    (got,), nfe = ours(model, [p], eos=(stop,), max_tokens=30)
    # The reference returns the stop token; the package's events cut before it.
    assert want[-1] == stop and got == want[:-1] and nfe == forwards
    assert len(got) == full.index(stop)


class _Draws:
    """The categorical draws of both sides from one table per forward: the engine's Gumbel noise
    is -log(-log(u)) of its uniform draw over the window's rows; the reference's multinomial takes
    argmax(log p + G) with the G of its mask rows."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.tables, self.j, self.remaining = [], 0, None

    def uniform(self, low=0.0, high=1.0, shape=(), key=None, **kw):
        u = np.clip(self.rng.random(shape[1:]).astype(np.float32), 1e-20, 1.0)
        self.tables.append(u)
        return mx.array(u[None])

    def process_mask_positions(self, real):
        def wrapped(mask_logits, remaining, *args):
            self.remaining = remaining
            return real(mask_logits, remaining, *args)

        return wrapped

    def multinomial(self, probs, num_samples, **kw):
        g = -np.log(-np.log(self.tables[self.j][self.remaining]))
        self.j += 1
        return (torch.log(probs) + torch.from_numpy(g)).argmax(-1, keepdim=True)


@pytest.mark.parametrize(
    "kw", [{"temperature": 1.0}, {"temperature": 3.0, "top_k": 100, "top_p": 0.999}]
)
def test_sampled_tokens_match_the_reference_with_the_same_draws(loaded, ckpt, monkeypatch, kw):
    model, _ = loaded
    p = prompt(6, 5)
    draws = _Draws(seed=7)
    with monkeypatch.context() as m:
        m.setattr(mx.random, "uniform", draws.uniform)
        (got,), nfe = ours(model, [p], max_tokens=20, **kw)
    monkeypatch.setattr(torch, "multinomial", draws.multinomial)
    monkeypatch.setattr(
        ref, "process_mask_positions", draws.process_mask_positions(ref.process_mask_positions)
    )
    want, forwards = reference(ckpt, p, 20, **kw)
    # Every forward draws once, but the last: it only commits the tokens that end the row.
    assert got == want and nfe == forwards == len(draws.tables) + 1 == draws.j + 1
    assert got != ours(model, [p], max_tokens=20)[0][0]


def test_batch_rows_of_different_lengths_equal_single_runs(loaded):
    model, tok = loaded
    prompts = [prompt(9, 10), prompt(3, 11), prompt(14, 12)]
    kw = dict(max_tokens=20)
    batch = batch_equal_to_single_runs(model, tok, prompts, **kw)
    assert all(len(t) == 20 for t in batch.tokens)


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_rows_step_together_and_each_gets_its_single_run(loaded, cache):
    """One run of rows of different lengths (the decoder's own batch: each row's K/V in its own
    columns, rows dropped as they finish, here at different steps through a stop token)."""
    model, _ = loaded
    prompts = [prompt(9, 20), prompt(3, 21), prompt(17, 22), prompt(1, 23)]
    kw = dict(max_tokens=24, cache=cache, entropy_threshold=0.6)
    (first,), _ = ours(model, prompts[:1], eos=(), **kw)
    stop = first[7]  # the first row stops early; the others later or never
    kw["eos"] = (stop,)
    batch, nfe = ours(model, prompts, **kw)
    singles = [ours(model, [p], **kw) for p in prompts]
    assert batch == [tokens for (tokens,), _ in singles]
    assert nfe == max(n for _, n in singles)  # one forward a step for the whole batch
    assert len({len(t) for t in batch}) > 1


def test_logprobs_are_those_of_the_step_that_filled_each_token(loaded):
    model, tok = loaded
    r = batch_generate_diffusion(model, tok, [prompt(6, 6)], max_tokens=12, logprobs=2)
    entries = r.logprobs[0]
    assert [e.token for e in entries] == r.tokens[0]
    for e in entries:  # greedy: the token is its step's most probable one
        assert e.top[0][0] == e.token and e.logprob == pytest.approx(e.top[0][1])
        assert e.logprob <= 0 and e.top[0][1] >= e.top[1][1]


# ------------------------------------------------------------------- mlx-lm, sharding, serve


# ------------------------------------------------------------------- the reconstructed config


def test_reconstructed_config_builds_the_full_model_lazily():
    from mlx.utils import tree_flatten

    cfg = json.loads((DATA / "config.json").read_text())
    args = wedlm.ModelArgs.from_dict(cfg)
    model = wedlm.Model(args)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 8.1e9 < count < 8.3e9  # Qwen3-8B: 8.19e9
    spec = model.diffusion_spec
    assert (spec.mask_token_id, spec.eos_token_ids, spec.max_position_embeddings) == (
        151666,
        (151643,),
        16384,
    )
    names = dict(tree_flatten(model.parameters()))
    assert "model.layers.0.self_attn.q_norm.weight" in names  # the Qwen3 body: q/k norms,
    assert "model.layers.0.self_attn.q_proj.bias" not in names  # no biases
    without_mask = {k: v for k, v in cfg.items() if k != "mask_token_id"}
    assert wedlm.ModelArgs.from_dict(without_mask).mask_token_id == wedlm.WEDLM_MASK_TOKEN_ID


def test_training_is_refused_with_why(loaded):
    """`mlx_dllm lora`'s masked-diffusion loss (full attention over a masked sequence) is not
    WeDLM's objective: refused, rather than silently training another model."""
    from mlx_dllm_models.training import family_loss

    model, _ = loaded
    with pytest.raises(ValueError, match="training objective .* is not implemented"):
        family_loss(model.diffusion_spec)


def test_a_restarted_constrained_row_continues_its_grammar(loaded):
    """The server restarts a row with what it returned appended to its prompt and passed as
    `consumed`: the grammar goes on from there (it does not start over), and the whole text
    matches."""
    from mlx_dllm_models.structured import compile_rows

    model, tok = loaded
    spec = model.diffusion_spec
    vocab = model(mx.array([[1]]), mask="causal").shape[-1]
    pattern = "abc-[0-9]{2,3}"
    (constraint,) = compile_rows(dict(regex=pattern), 1, tok, vocab, [IM_END])
    settings = resolve_settings(spec, dict(max_tokens=8, temperature=0), {})
    done = tok.encode("abc")
    decoder = make_decoder(model, settings, [IM_END], constraints=[constraint])
    out, ended = [], False
    for event in decoder.run([tok.encode("Hello") + done], consumed=[done]):
        if isinstance(event, BlockEvent):
            out += event.tokens[0]
            ended = ended or event.eos[0]
    text = tok.decode(done + out)
    assert re.fullmatch(pattern, text), text
    assert ended  # EOS, where the grammar accepts, before max_tokens
