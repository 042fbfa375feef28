"""What the block-diffusion decoding tests share (SDAR, SDAR-MoE, LLaDA2.x): their fixtures, a
run's tokens, and the independent forwards the reference loops call (transformers' SDAR, mlx-vlm's
llada2_moe; tests/test_published_calls.py calls them too, and the forward-parity tests hold the
package's LLaDA2 against mlx-vlm's language model itself)."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures import llada2 as llada2_fixture
from fixtures import sdar as sdar_fixture
from helpers import load_fixture
from mlx_dllm_models.engine import BlockEvent
from mlx_dllm_models.generate import stream_events
from reference.sdar_torch import load_reference

BUILDERS = {
    "sdar": sdar_fixture.build_sdar,
    "sdar_moe": sdar_fixture.build_sdar_moe,
    "llada2_moe": llada2_fixture.build,
}


def family_fixture():
    """A test module's module-scoped fixture `family`, bound as `family = family_fixture()`:
    `family(name)` is (path, model, tokenizer) of the fixture BUILDERS[name] writes, loaded once
    a module."""

    @pytest.fixture(scope="module")
    def family(fixture_dir):
        loaded = {}

        def get(name):
            if name not in loaded:
                path = build_once(fixture_dir / name, BUILDERS[name])
                loaded[name] = (path, *load_fixture(path))
            return loaded[name]

        return get

    return family


def run(model, tok, prompts, **kw):
    """Tokens and finish reasons of each row, and the decoder (its backend holds the counters)."""
    _, ids, decoder = stream_events(model, tok, prompts, **kw)
    out, reasons = [[] for _ in ids], ["length"] * len(ids)
    for event in decoder.run(ids):
        if isinstance(event, BlockEvent):
            for row, toks, hit in zip(event.rows, event.tokens, event.eos):
                out[row].extend(toks)
                reasons[row] = "stop" if hit else reasons[row]
    return out, reasons, decoder


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def transformers_forward(path):
    model = load_reference(str(path))

    def forward(ids, keep):
        n = ids.shape[1]
        additive = torch.zeros(n, n).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]
        with torch.no_grad():
            out = model(
                input_ids=ids,
                attention_mask=additive,
                position_ids=torch.arange(n)[None],
                use_cache=False,
            )
        return out.logits.float()

    return forward


def read_weights(path):
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def mlx_vlm_language_model(path):
    """mlx-vlm's llada2_moe on the same checkpoint, through its own config and sanitize."""
    from mlx_vlm.models.llada2_moe import Model
    from mlx_vlm.models.llada2_moe.config import ModelConfig

    cfg = json.loads((path / "config.json").read_text())
    model = Model(ModelConfig.from_dict(cfg))
    model.load_weights(list(model.sanitize(read_weights(path)).items()))
    return model.language_model


def mlx_vlm_forward(path):
    """mlx-vlm's llada2_moe (an independent implementation) under the reference's mask."""
    language_model = mlx_vlm_language_model(path)

    def forward(ids, keep):
        logits = language_model(
            mx.array(ids.numpy()), mask=mx.array(keep.numpy())[None, None]
        ).logits
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    return forward
