"""Fast-dLLM v2 (model_type Fast_dLLM_Qwen): the forward against a PyTorch transcription of its
remote modeling.py, token parity at temperature 0 with the transcribed `generate` (sub-blocks,
threshold, token shift, the argmax seed of each block, stop-token rules), the exact prefix cache
against full recompute, batch rows against single runs, the sub-block rule, the family's
defaults and bad input."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import fast_dllm_v2 as fx
from helpers import assert_close, checkpoint_fixtures, far, load_fixture
from mlx_dllm_models import SettingsError, batch_generate_diffusion
from mlx_dllm_models.decoding.samplers import StepContext
from mlx_dllm_models.decoding.stats import TokenStats
from mlx_dllm_models.decoding.sub_block import sub_block_commit, sub_block_index
from mlx_dllm_models.masks import block_causal_mask
from mlx_dllm_models.settings_fields import ResolvedSettings
from reference.fast_dllm_v2_torch import Reference

checkpoint, loaded = checkpoint_fixtures(
    "fast_dllm_v2", fx.build, name="checkpoint", loader=load_fixture
)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return Reference(checkpoint)


def prompt(n, seed=None):
    return np.random.default_rng(n if seed is None else seed).integers(0, 256, n).tolist()


# ----------------------------------------------------------------------------------- forward


def test_forward_matches_the_reference_under_the_block_causal_mask(loaded, ref):
    model, _ = loaded
    ids = prompt(70)
    mine = np.array(model(mx.array([ids]), mask=block_causal_mask(70, fx.BLOCK_SIZE)))
    theirs = ref.forward(torch.tensor([ids]), None, False, fx.BLOCK_SIZE).numpy()
    assert_close(mine, theirs)
    # A causal mask (the AR base model's) is not what the checkpoint runs.
    assert far(np.array(model(mx.array([ids]), mask="causal")), theirs)


def test_a_block_against_the_prefix_cache_matches_the_reference(loaded, ref):
    """The reference's decoding forward: the prompt's whole blocks stored, then a block window
    that reads them (update_past_key_values=False) at absolute positions."""
    from mlx_dllm_models.cache import PrefixKVCache

    model, _ = loaded
    ids = prompt(96)
    cache = PrefixKVCache(len(model.layers), 96, None)
    model(mx.array([ids[:64]]), cache=cache.at(0), mask=block_causal_mask(64, fx.BLOCK_SIZE))
    cache.commit(64)
    mine = np.array(model(mx.array([ids[64:]]), cache=cache.at(64)))
    past = []
    ref.forward(torch.tensor([ids[:64]]), past, True, fx.BLOCK_SIZE)
    theirs = ref.forward(torch.tensor([ids[64:]]), past, False, fx.BLOCK_SIZE).numpy()
    assert_close(mine, theirs)


# ---------------------------------------------------------------------------------- decoding

# (prompt length, settings): prompts inside a block, past one (unaligned), on a block edge (the
# prefill's argmax seeds the first block) and just past one; sub-blocks of 4, 8 (the recipe) and
# the whole block; thresholds 0.5, 0.9 (the recipe) and 1 (the remote generate's default: one
# token a step). Greedy decoding of a tiny random model: steps that pick between near-equal
# confidences could flip with float noise, so the cases are fixed.
PARITY = [
    (7, {}),
    (7, {"sub_block_length": 4, "threshold": 0.5}),
    (45, {}),
    (45, {"threshold": 1.0}),
    (45, {"sub_block_length": 32}),
    (64, {}),
    (64, {"threshold": 1.0}),
    (64, {"sub_block_length": 4, "threshold": 0.5}),
    (33, {}),
    (33, {"threshold": 1.0}),
    (31, {"sub_block_length": 32}),
]


@pytest.mark.slow
@pytest.mark.parametrize("length, settings", PARITY)
@pytest.mark.parametrize("cache", ["auto", "none"])
def test_tokens_match_the_reference_generate(loaded, ref, length, settings, cache):
    model, tok = loaded
    ids = prompt(length)
    got = batch_generate_diffusion(model, tok, [ids], max_tokens=80, cache=cache, **settings)
    want = fx.reference_tokens(ref, ids, 80, settings)
    assert got.tokens[0] == want
    assert got.finish_reasons[0] == ("stop" if len(want) < 80 else "length")


@pytest.mark.slow
def test_the_cases_stop_at_eos_and_run_long(loaded, ref):
    # The parity cases hold both endings: an EOS in a block (the stop-token rules) and 80 tokens.
    ends = {len(fx.reference_tokens(ref, prompt(n), 80, s)) < 80 for n, s in PARITY}
    assert ends == {True, False}


@pytest.mark.slow
def test_a_wrong_shift_or_no_seed_changes_the_tokens(loaded, ref):
    """The two declarations the family's decoding rests on are each seen by the parity test."""
    import dataclasses

    model, tok = loaded
    ids = prompt(64)
    want = fx.reference_tokens(ref, ids, 80, {})
    spec = model.diffusion_spec
    try:
        for wrong in ({"logit_shift": 0, "seeds_block_start": False}, {"seeds_block_start": False}):
            model.diffusion_spec = dataclasses.replace(spec, **wrong)
            got = batch_generate_diffusion(model, tok, [ids], max_tokens=80).tokens[0]
            assert got != want, wrong
    finally:
        model.diffusion_spec = spec


@pytest.mark.slow
def test_batch_rows_of_different_lengths_equal_single_runs(loaded):
    model, tok = loaded
    prompts = [prompt(n) for n in (7, 45, 64, 33, 100)]
    for cache in ("auto", "none"):
        batch = batch_generate_diffusion(model, tok, prompts, max_tokens=70, cache=cache)
        for i, p in enumerate(prompts):
            alone = batch_generate_diffusion(model, tok, [p], max_tokens=70, cache=cache)
            assert batch.tokens[i] == alone.tokens[0], (cache, i)


def test_prefix_cache_runs_fewer_positions_than_full_recompute(loaded):
    from mlx_dllm_models.generate import stream_events

    model, tok = loaded
    widths = {}
    for cache in ("auto", "none"):
        calls = []
        real = type(model).__call__

        def spy(self, inputs, cache=None, mask=None, head_span=None, _calls=calls):
            _calls.append(inputs.shape[1])
            return real(self, inputs, cache=cache, mask=mask, head_span=head_span)

        type(model).__call__ = spy
        try:
            _, ids, decoder = stream_events(model, tok, [prompt(45)], max_tokens=64, cache=cache)
            list(decoder.run(ids))
        finally:
            type(model).__call__ = real
        widths[cache] = calls
    # The cache's denoising forwards cover one block; full recompute's the whole sequence.
    assert max(widths["auto"][1:]) <= fx.BLOCK_SIZE < min(widths["none"])
    assert len(widths["auto"]) == len(widths["none"]) + 1  # + the prompt's prefill


# ----------------------------------------------------------------------------- the sub-block rule


def test_sub_block_index_reads_a_window_from_the_block_end():
    # A first block after a 7-token prompt tail: columns are block positions 7..31.
    idx = sub_block_index(25, 32, 8).tolist()
    assert idx[:2] == [0, 1] and idx[-1] == 3 and idx.count(0) == 1 and idx.count(3) == 8
    assert sub_block_index(32, 32, 8).tolist() == [i // 8 for i in range(32)]


def _ctx(floor, threshold=0.9, sub=4, block=8):
    settings = ResolvedSettings.from_dict(
        {"threshold": threshold, "sub_block_length": sub, "block_length": block}
    )
    spec = type("S", (), {"strict_threshold": True})()
    return StepContext(0, block, mx.array(floor), None, settings, spec)


def _stats(conf):
    conf = mx.array(conf, dtype=mx.float32)
    return TokenStats(mx.zeros(conf.shape, mx.int32), conf, mx.zeros(conf.shape))


def test_sub_block_commit_stays_in_the_first_open_sub_block():
    conf = [[0.95, 0.2, 0.91, 0.3, 0.99, 0.99, 0.99, 0.99]]
    cand = mx.array([[False, True, True, True, True, True, True, True]])
    got = sub_block_commit(_stats(conf), cand, _ctx([1])).tolist()
    # Sub-block 0 (columns 0-3): 0.91 passes, > 0.9 strictly; nothing of sub-block 1.
    assert got == [[False, False, True, False, False, False, False, False]]
    # Nothing passes: the most confident of the sub-block, never a later one.
    low = [[0.1, 0.2, 0.4, 0.3, 0.99, 0.99, 0.99, 0.99]]
    got = sub_block_commit(_stats(low), cand, _ctx([1])).tolist()
    assert got == [[False, False, True, False, False, False, False, False]]
    # A threshold of exactly the confidence does not pass (x1_p > threshold).
    got = sub_block_commit(_stats(low), cand, _ctx([1], threshold=0.4)).tolist()
    assert sum(got[0]) == 1


def test_sub_block_floor_spills_in_order_when_steps_are_few():
    conf = [[0.1, 0.2, 0.4, 0.3, 0.5, 0.6, 0.7, 0.8]]
    cand = mx.array([[True] * 8])
    got = sub_block_commit(_stats(conf), cand, _ctx([6])).tolist()[0]
    # Six a step (two steps for eight positions): sub-block 0 whole, then 1's best two.
    assert got == [True, True, True, True, False, False, True, True]


def test_fewer_steps_than_positions_still_complete_the_blocks(loaded):
    model, tok = loaded
    out = batch_generate_diffusion(model, tok, [prompt(45)], max_tokens=64, steps=5)
    assert len(out.tokens[0]) > 0 and fx.MASK not in out.tokens[0]


# ------------------------------------------------------------------------- defaults, bad input


def test_defaults_are_the_model_cards_recipe(loaded):
    from mlx_dllm_models.request import checkpoint_settings
    from mlx_dllm_models.settings import resolve_settings

    model, _ = loaded
    spec = model.diffusion_spec
    s = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    assert (s.block_length, s.sampler, s.sub_block_length) == (32, "sub_block", 8)
    assert (s.threshold, s.temperature, s.max_tokens, s.steps) == (0.9, 0.0, 512, 32)
    # The fixture's generation_config.json holds Qwen2.5's AR sampling values: unread.
    assert s.top_p != 0.8 and s.top_k != 20
    assert spec.logit_shift == 1 and spec.seeds_block_start and spec.eos_ends_block
    assert spec.mask_token_id == fx.MASK and spec.eos_token_ids == (fx.IM_END,)


def test_published_config_reads_with_the_families_ids(tmp_path):
    from mlx_dllm_models.models.fast_dllm_qwen import FAST_DLLM_MASK_TOKEN_ID, ModelArgs

    real = json.loads(
        (
            __import__("pathlib").Path(__file__).parent
            / "data/Efficient-Large-Model__Fast_dLLM_v2_7B/config.json"
        ).read_text()
    )
    # The quoted keys stop before vocab_size; Qwen2.5-7B's is 152064.
    args = ModelArgs.from_dict(dict(real, vocab_size=152064, rms_norm_eps=1e-6))
    assert args.bd_size == 32 and args.mask_token_id == FAST_DLLM_MASK_TOKEN_ID == 151665
    assert args.eos_token_id == 151645 and args.tie_word_embeddings is False
    # Built at full size (MLX arrays are lazy: nothing is allocated): Qwen2.5-7B's 7.62e9.
    from mlx.utils import tree_flatten

    from mlx_dllm_models.models.fast_dllm_qwen import Model

    model = Model(args)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 7.6e9 < count < 7.65e9
    spec = model.diffusion_spec
    assert spec.trained_block_length == 32 and spec.defaults["block_length"] == 32


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"sub_block_length": 5}, r"sub_block_length \(5\) must divide block_length \(32\)"),
        ({"sub_block_length": 4, "sampler": "threshold"}, "only acts with sampler='sub_block'"),
        ({"sub_block_length": 0}, "sub_block_length must be a positive integer"),
        ({"block_length": 4}, r"sub_block_length \(8\) must divide block_length \(4\)"),
    ],
)
def test_bad_settings_say_what_to_do(loaded, settings, message):
    model, tok = loaded
    with pytest.raises(SettingsError, match=message) as e:
        batch_generate_diffusion(model, tok, [prompt(5)], max_tokens=8, **settings)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bd_size": 0}, "bd_size .* must be a positive integer"),
        ({"mask_token_id": 999}, "mask_token_id 999 is outside the vocabulary"),
    ],
)
def test_bad_config_is_one_clear_error(checkpoint, tmp_path, change, message):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, **change)))
    with pytest.raises(ValueError, match=message):
        load_fixture(bad)


@pytest.mark.slow
def test_logprobs_of_a_blocks_seed_are_its_argmax_logit(loaded, ref):
    """A block's first token, which no step decides, gets the log-probability of the finished
    prefix's last logit (the reference's forward over the prefix), and leads its alternatives."""
    model, tok = loaded
    ids = prompt(33)
    plain = batch_generate_diffusion(model, tok, [ids], max_tokens=80)
    out = batch_generate_diffusion(model, tok, [ids], max_tokens=80, logprobs=3)
    assert out.tokens == plain.tokens and len(out.tokens[0]) == 80
    seq = ids + out.tokens[0]
    for column in (64, 96):  # the seeds of the second and third blocks
        logits = ref.forward(torch.tensor([seq[:column]]), None, False, fx.BLOCK_SIZE)[0, -1]
        want = torch.log_softmax(logits.double(), -1)[seq[column]].item()
        entry = out.logprobs[0][column - len(ids)]
        assert entry.token == seq[column] == entry.top[0][0]
        assert abs(entry.logprob - want) < 1e-4
