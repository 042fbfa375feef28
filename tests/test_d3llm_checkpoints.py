"""d3LLM's distilled checkpoints (d3LLM/d3LLM_LLaDA, d3LLM/d3LLM_Dream, d3LLM/d3LLM_Dream_Coder,
hao-ai-lab/d3LLM @ e5bfcac) load as their base family and decode, at d3LLM's published call, as a
transcription of that call does (tests/reference/d3llm_multi_block.py).

Their config.json: d3LLM's training (d3llm/d3llm_LLaDA/distill_2_training/d3llm_train.yaml,
d3llm_DREAM's likewise) loads the base with AutoModel (GSAI-ML/LLaDA-8B-Instruct,
Dream-org/Dream-v0-Instruct-7B; LoRA merged) and saves it with save_pretrained, so the published
config is the base's: its model_type ("llada", "Dream"), architectures and auto_map. The files
themselves were not found (the Hub pages are not stored); the fixtures here are the base's real
config.json (tests/data) at the family fixture's sizes and ids. The published call: the chat
scripts' (chat/chat_d3llm_llada.py, chat_d3llm_dream.py): max_new_tokens 256, block_size 32,
threshold 0.5, block_add_threshold 0.1, decoded_token_threshold 0.95, early_stop, temperature 0.
"""

import json
from pathlib import Path

import pytest

from fixtures import build_once
from fixtures import dream as dream_fixture
from fixtures import llada as llada_fixture
from helpers import decoded, random_prompt
from mlx_dllm_models import load
from mlx_dllm_models.engine import make_decoder
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import resolve_settings
from reference.d3llm_multi_block import multi_block_generate
from reference.dream_torch import reference_forward
from reference.llada_torch import torch_forward

DATA = Path(__file__).parent / "data"

# The sizes and special ids the fixture's weights and tokenizer need; every other field is the real
# base config's.
LLADA_FIXTURE_KEYS = (
    "d_model n_layers n_heads n_kv_heads mlp_hidden_size vocab_size embedding_size "
    "max_sequence_length mask_token_id eos_token_id pad_token_id bos_token_id torch_dtype"
).split()
DREAM_FIXTURE_KEYS = (
    "hidden_size intermediate_size num_attention_heads num_hidden_layers num_key_value_heads "
    "max_window_layers vocab_size mask_token_id eos_token_id pad_token_id bos_token_id torch_dtype"
).split()

# The chat scripts' call, as the engine's settings.
PUBLISHED_CALL = dict(
    max_tokens=256,
    block_size=32,
    threshold=0.5,
    block_add_threshold=0.1,
    decoded_token_threshold=0.95,
    early_stop=True,
    temperature=0.0,
)


def _with_real_config(path: Path, real: str, keys) -> Path:
    fixture = json.loads((path / "config.json").read_text())
    config = json.loads((DATA / real / "config.json").read_text())
    config.pop("_name_or_path", None)
    config.update({k: fixture[k] for k in keys if k in fixture})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def build_d3llm_llada(path):
    llada_fixture.build_llada(path)
    return _with_real_config(Path(path), "GSAI-ML__LLaDA-8B-Instruct", LLADA_FIXTURE_KEYS)


def build_d3llm_dream(path):
    dream_fixture.build(path)
    return _with_real_config(Path(path), "Dream-org__Dream-v0-Instruct-7B", DREAM_FIXTURE_KEYS)


CASES = {
    "d3llm_llada": (build_d3llm_llada, "llada", llada_fixture.LLADA_TOKENS["<|endoftext|>"]),
    "d3llm_dream": (build_d3llm_dream, "dream", dream_fixture.ENDOFTEXT),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, fixture_dir):
    build, form, eos = CASES[request.param]
    path = build_once(fixture_dir / request.param, build)
    model, tok = load(path)
    return form, path, model, tok, eos


def test_loads_as_its_base_family(checkpoint):
    form, path, model, _, _ = checkpoint
    real = json.loads((path / "config.json").read_text())
    assert real["model_type"] == {"llada": "llada", "dream": "Dream"}[form]
    assert "auto_map" in real and model.diffusion_spec.family == form
    assert "d3llm" in model.diffusion_spec.samplers


def test_the_sampler_brings_the_published_call(checkpoint):
    _, _, model, _, _ = checkpoint
    spec = model.diffusion_spec
    s = resolve_settings(spec, {"sampler": "d3llm"}, checkpoint_settings(model, spec))
    assert {k: getattr(s, k) for k in PUBLISHED_CALL} == PUBLISHED_CALL


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_the_published_call_matches_the_reference(checkpoint, seed):
    """Tokens and forwards at the chat scripts' call (early stop at the fixture's EOS). A run where
    the reference committed the mask token itself (its argmax is unrestricted) is not comparable."""
    form, path, model, _, eos = checkpoint
    spec = model.diffusion_spec
    s = resolve_settings(spec, {"sampler": "d3llm"}, checkpoint_settings(model, spec))
    p = random_prompt(7, seed)
    (got,), nfe = decoded(make_decoder(model, s, eos_token_ids={eos}), [p])
    if form == "llada":
        forward, mask = torch_forward(path), spec.mask_token_id
    else:
        dream = reference_forward(path)
        forward, mask = (lambda x: dream(x, None, None)), spec.mask_token_id
    call = {k: v for k, v in PUBLISHED_CALL.items() if k not in ("max_tokens", "temperature")}
    seq, _, forwards, mask_commits = multi_block_generate(
        forward, p, 256, form=form, mask_id=mask, eos_token_id=eos, **call
    )
    want = seq[len(p) :].tolist()
    want = want[: want.index(eos)] if eos in want else want
    assert (got == want and nfe == forwards) or mask_commits
    assert mask_commits == 0 or seed != 0  # the first run is comparable
