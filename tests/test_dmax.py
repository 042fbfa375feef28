"""DMax (LLaDA2.0-mini fine-tunes) through the `dmax` decoder: its rules against the dInfer
transcription's, the model's forward from input embeddings, token and forward parity with the
authors' decoding loop (tests/reference/dmax_dinfer.py) at its evaluation defaults, its resolved
defaults, rows of a batch decoding as alone, and its reach through `convert --model-type dmax`."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures import dmax as dmax_fixture
from helpers import load_fixture, mlx_vlm_llada2, run_cli
from mlx_dllm_models.cache import PrefixKVCache
from mlx_dllm_models.conversion import retyped_config
from mlx_dllm_models.decoding.dmax import best_tokens, prefix_commit, soft_embeddings
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.masks import block_causal_mask
from mlx_dllm_models.settings import SettingsError, resolve_settings
from reference import dmax_dinfer

MASK, EOS, BLOCK = dmax_fixture.MASK, dmax_fixture.EOS, dmax_fixture.BLOCK_LENGTH


@pytest.fixture(scope="module")
def dmax(fixture_dir):
    path = build_once(fixture_dir / "dmax", dmax_fixture.build_converted)
    return (path, *load_fixture(path))


def vlm_ops(path):
    """The reference's arithmetic in torch on mlx-vlm's llada2_moe (an independent
    implementation): the prefix read from its ids, the block from its ids or embeddings."""
    lm = mlx_vlm_llada2(path, model_type="llada2_moe")
    table = lm.model.word_embeddings.weight

    def forward(prefix, block):
        ids = mx.array(prefix.numpy())
        if block.dtype == torch.long:
            ids = mx.concatenate([ids, mx.array(block.numpy())], axis=1)
            h = lm.model.word_embeddings(ids)
        else:
            h = mx.concatenate([lm.model.word_embeddings(ids), mx.array(block.numpy())], axis=1)
        keep = block_causal_mask(h.shape[1], BLOCK)
        logits = lm(None, inputs_embeds=h, mask=keep).logits[:, prefix.shape[1] :]
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    table = torch.from_numpy(np.array(table.astype(mx.float32)))
    return dmax_dinfer.TorchOps(forward, table, MASK)


class PackageOps:
    """The reference loop's arithmetic done by this package (the model's forwards on a prefix
    cache kept as dInfer keeps its own, decoding.dmax's statistics and soft embeddings), so that the
    loop's control flow is compared on the same floats: the fixture's random model amplifies float
    noise through the soft embeddings over tens of forwards."""

    def __init__(self, model):
        self.model = model
        self.cache = PrefixKVCache(len(model.layers), 4096)
        self.prefilled = False
        self.mask = model.embed(mx.array([MASK]))[0]

    def forward(self, prefix, block):
        p, cache = prefix.shape[1], self.cache
        if not self.prefilled and p:
            self.model(
                mx.array(prefix.numpy()), cache=cache.at(0), mask=block_causal_mask(p, BLOCK)
            )
            cache.commit(p)
        self.prefilled = True
        if p > cache.committed:  # the finished block rides along and gets its final K/V
            ids = mx.array(torch.cat([prefix[:, cache.committed :], block], dim=1).numpy())
            keep = block_causal_mask(ids.shape[1], BLOCK, offset=cache.committed)
            logits = self.model(ids, cache=cache.at(cache.committed), mask=keep)[:, -BLOCK:]
            cache.commit(p)
        elif block.dtype == torch.long:
            logits = self.model(mx.array(block.numpy()), cache=cache.at(p))
        else:
            ids = mx.zeros(block.shape[:2], dtype=mx.int32)
            embeddings = mx.array(block.numpy())
            logits = self.model(ids, cache=cache.at(p), input_embeddings=embeddings)
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    def embed(self, ids):
        return torch.from_numpy(np.array(self.model.embed(mx.array(ids.numpy()))))

    def stats(self, logits):
        x0, p = best_tokens(mx.array(logits.numpy()))
        return torch.from_numpy(np.array(x0)).long(), torch.from_numpy(np.array(p))

    def mix(self, max_probs, x0):
        p, own = mx.array(max_probs.numpy()), self.model.embed(mx.array(x0.numpy()))
        return torch.from_numpy(np.array(soft_embeddings(p, own, self.mask)))


def decode(model, tok, prompts, **kw):
    """Each row's tokens (with its EOS when it met one) and the decoder."""
    _, ids, decoder = stream_events(model, tok, prompts, **kw)
    out = [[] for _ in ids]
    for event in decoder.run(ids):
        if type(event).__name__ == "BlockEvent":
            for row, toks, hit in zip(event.rows, event.tokens, event.eos):
                out[row] += toks + ([EOS] if hit else [])
    return out, ids, decoder


def test_prefix_commit_matches_the_reference_selection():
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = rng.random((1, 12)).astype(np.float32)
        masks = rng.random((1, 12)) < 0.6
        got = prefix_commit(mx.array(p), mx.array(masks), 0.5)
        want = dmax_dinfer.transfer_index_uniform(torch.tensor(p), torch.tensor(masks), 0.5)
        assert np.array_equal(np.array(got), want.numpy())


def test_soft_embeddings_match_the_reference_mix():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((10, 6)).astype(np.float32)
    tokens = np.array([[1, 4, 7, 2]])
    p = rng.random((1, 4)).astype(np.float32)
    got = soft_embeddings(mx.array(p), mx.array(table[tokens]), mx.array(table[MASK % 10]))
    table_t = torch.tensor(table)
    want = dmax_dinfer.soft_mix(torch.tensor(p), torch.tensor(tokens), table_t, MASK % 10)
    assert np.allclose(np.array(got), want.numpy(), atol=1e-6)


def test_forward_from_embeddings_is_the_forward_from_ids(dmax):
    _, model, _ = dmax
    ids = mx.array([[5, 9, 77, MASK, MASK, 30]])
    keep = block_causal_mask(6, 4)
    plain = model(ids, mask=keep)
    embedded = model(ids, mask=keep, input_embeddings=model.embed(ids))
    assert mx.array_equal(plain, embedded)


def test_resolved_defaults_are_dinfers_evaluation_values(dmax):
    _, model, _ = dmax
    settings = resolve_settings(model.diffusion_spec, {})
    assert {
        k: getattr(settings, k) for k in ("block_length", "threshold", "temperature", "max_tokens")
    } == {
        "block_length": 32,
        "threshold": 0.5,
        "temperature": 0.0,
        "max_tokens": 2048,
    }
    assert settings.sampler == "threshold"
    with pytest.raises(SettingsError, match="steps"):
        resolve_settings(model.diffusion_spec, {"steps": 8})


def check_parity(model, tok, ops, prompt, max_tokens, threshold):
    got, ids, decoder = decode(model, tok, [prompt], max_tokens=max_tokens, threshold=threshold)
    want, nfe = dmax_dinfer.generate(ops, ids[0], max_tokens, BLOCK, MASK, EOS, threshold)
    assert got[0] == want[:max_tokens]
    # dInfer prefills a block of masks before a prompt shorter than a block; not run here.
    assert decoder.nfe == nfe - (1 if len(ids[0]) < BLOCK else 0)
    return decoder.nfe


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt, max_tokens, threshold",
    [("Hi", 40, 0.5), ("a" * 40, 64, 0.5), ("Once upon a time", 96, 0.9), ("b" * 70, 30, 0.2)],
)
def test_tokens_and_forwards_match_the_dinfer_loop(dmax, prompt, max_tokens, threshold):
    _, model, tok = dmax
    nfe = check_parity(model, tok, PackageOps(model), prompt, max_tokens, threshold)
    assert nfe > -(-(len(prompt) + max_tokens) // BLOCK)  # soft steps ran, not one per block


@pytest.mark.slow
def test_tokens_and_forwards_match_dinfer_on_an_independent_forward(dmax):
    """The whole reference in torch on mlx-vlm's model, on a request whose blocks settle in a few
    forwards (so float noise has no room to grow)."""
    path, model, tok = dmax
    check_parity(model, tok, vlm_ops(path), "The sum of 3 and 4 is", 50, 0.3)


@pytest.mark.slow
def test_rows_of_a_batch_decode_as_alone(dmax):
    _, model, tok = dmax
    prompts = ["Hi", "a" * 40]
    together, _, _ = decode(model, tok, prompts, max_tokens=40)
    alone = [decode(model, tok, [p], max_tokens=40)[0][0] for p in prompts]
    assert together == alone


def test_temperature_above_zero_is_refused(dmax):
    _, model, tok = dmax
    with pytest.raises(SettingsError, match="temperature 0"):
        decode(model, tok, ["Hi"], max_tokens=8, temperature=0.7)


def test_convert_model_type_dmax_retypes_a_llada2_checkpoint(tmp_path):
    source = dmax_fixture.build(tmp_path / "published")
    assert json.loads((source / "config.json").read_text())["model_type"] == "llada2_moe"
    assert retyped_config(source, "dmax") == {"model_type": "dmax"}


@pytest.mark.slow
def test_a_cancelled_row_leaves_before_its_next_forward(dmax):
    _, model, tok = dmax
    _, ids, decoder = stream_events(model, tok, ["Hi", "a" * 40], max_tokens=40)
    cancelled, rows_after, blocks = set(), [], {0: [], 1: []}
    for event in decoder.run(ids, cancelled=cancelled):
        if cancelled:
            rows_after.append(event.rows)
        if type(event).__name__ == "StepEvent" and event.rows == [0]:
            cancelled.add(0)
        if type(event).__name__ == "BlockEvent":
            for row, toks in zip(event.rows, event.tokens):
                blocks[row] += toks
    assert rows_after and all(0 not in rows for rows in rows_after[1:])
    assert blocks[1], "the other row decoded nothing"
    assert (
        blocks[0] == []
        and blocks[1] == decode(model, tok, ["a" * 40], max_tokens=40)[0][0][: len(blocks[1])]
    )


@pytest.mark.slow
def test_mlx_dllm_convert_model_type_dmax_then_decodes_as_dmax(dmax, tmp_path):
    _, model, tok = dmax
    out = tmp_path / "mlx"
    source = dmax_fixture.build(tmp_path / "published")
    proc = run_cli(
        "convert", "--hf-path", str(source), "--mlx-path", str(out), "--model-type", "dmax"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["model_type"] == "dmax"
    converted, converted_tok = load_fixture(out)
    assert converted.diffusion_spec.decoder == "dmax"
    want = decode(model, tok, ["Hi"], max_tokens=16)[0]
    assert decode(converted, converted_tok, ["Hi"], max_tokens=16)[0] == want and want[0]
