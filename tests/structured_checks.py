"""What the structured-output tests share: the fixture of every family and backend they decode
(FAMILIES), their module-scoped loader, and one prompt's run."""

import pytest

from fixtures import (
    build_once,
    coda,
    dllm,
    dream,
    fast_dllm_v2,
    idlm,
    llada,
    llada2,
    nemotron,
    rnd1,
    sdar,
    wedlm,
)
from fixtures import diffusion_gemma as dgfx
from fixtures.llada_v import build_llada_v
from helpers import load_fixture
from mlx_dllm_models import load, stream_generate_diffusion

# family -> (fixture builder, settings); every family's fixture, and each backend that decodes
# in a different order (Fast-dLLM's dual cache, Nemotron's recompute, LLaDA2.1's token editing).
FAMILIES = {
    "llada": (llada.build_llada, {}),
    "llada_moe": (llada.build_llada_moe, {}),
    "llada dual cache": (llada.build_llada, dict(cache="dual")),
    "dream": (dream.build, {}),
    "sdar": (sdar.build_sdar, {}),
    "sdar_moe": (sdar.build_sdar_moe, {}),
    "llada2": (llada2.build, {}),
    "llada2 editing": (llada2.build, dict(threshold=0.7, editing_threshold=0.6, max_post_steps=4)),
    "nemotron": (nemotron.build, {}),
    "nemotron recompute": (nemotron.build, dict(cache="none")),
    "nemotron self_spec": (nemotron.build, dict(mode="self_spec")),
    "nemotron self_spec draft adapter": (nemotron.build_with_draft_adapter, dict(mode="self_spec")),
    "fast_dllm_v2": (fast_dllm_v2.build, {}),
    "fast_dllm_v2 recompute": (fast_dllm_v2.build, dict(cache="none")),
    "fast_dllm_v2 sub_block cache": (fast_dllm_v2.build, dict(cache="sub_block")),
    "dream d3llm": (dream.build, dict(sampler="d3llm")),
    "rnd1": (rnd1.build, {}),
    "coda": (coda.build, {}),
    # WeDLM's window: a constrained row fills a grammar-valid prefix of it; its K/V kept or not.
    "wedlm": (wedlm.build, {}),
    "wedlm recompute": (wedlm.build, dict(cache="none")),
    # I-DLM's strided decoding: a constrained row keeps grammar-valid drafts only.
    "idlm": (idlm.build_converted, {}),
    # dllm's A2D conversions, under both of their samplers.
    "a2d mdlm": (dllm.build, dict(sampler="mdlm")),
    "a2d bd3lm": (dllm.build, dict(sampler="bd3lm")),
    # LLaDA-V on a text prompt (its language model is LLaDA's, loaded through mlx-vlm).
    "llada_v": (build_llada_v, {}),
    # The canvas: its readout follows the grammar. Its temperature is a schedule of its own.
    "diffusion_gemma": (dgfx.CHECKPOINTS["diffusion_gemma"], {}),
}
NO_TEMPERATURE = {"diffusion_gemma"}
# Loaded by the package's loader (mlx-vlm's, with their processors).
VLM = {"diffusion_gemma", "llada_v"}

_LOADED = {}


def models_fixture():
    """A test module's module-scoped fixture `models`, bound as `models = models_fixture()`:
    `models(name)` is (model, tokenizer) of FAMILIES[name]'s fixture, built and loaded once a
    session."""

    @pytest.fixture(scope="module")
    def models(fixture_dir):
        def get(name):
            build = FAMILIES[name][0]
            key = build.__module__ + "." + build.__name__
            if key not in _LOADED:
                path = build_once(fixture_dir / f"structured_{key}", build)
                # DiffusionGemma's processor comes from the package's loader (mlx-vlm's).
                _LOADED[key] = load(path) if name in VLM else load_fixture(path)
            return _LOADED[key]

        return get

    return models


def run(model, tok, prompt, **kw):
    """(text, tokens, finish_reason, nfe) of one prompt."""
    text, tokens, last = "", [], None
    for last in stream_generate_diffusion(model, tok, prompt, **kw):
        text += last.text
        tokens += last.tokens
    return text, tokens, last.finish_reason, last.nfe
