"""Dream-Coder 7B and DiffuCoder 7B: Dream checkpoints (model_type "Dream", Dream's remote code), so
the dream family decodes them. Their real config.json files (tests/data, README there) build the
model at full size with the right mask / EOS / BOS ids and context; what differs from Dream is
declared where the package can tell: DiffuCoder's <|dlm_pad|> ends a row's text (spec
eos_token_names, through the checkpoint's tokenizer). Their model cards' temperatures cannot be told
apart from Dream's by any file found (tests/test_real_recommended_settings.py holds them as strict
xfails).
Tiny checkpoints in their layout go through plain `python -m mlx_lm convert` and `mlx_lm.load`."""

import json
import shutil
from pathlib import Path

import pytest
from mlx.utils import tree_flatten

from fixtures import build_once
from fixtures import dream as dream_fixture
from fixtures.tokenizers import DREAM
from helpers import convert_and_generate
from mlx_dllm_models import batch_generate_diffusion, load
from mlx_dllm_models.models import dream
from mlx_dllm_models.request import checkpoint_settings, eos_ids, prepare
from mlx_dllm_models.settings import resolve_settings
from mlx_dllm_models.tiny import build_tokenizer, write_checkpoint

DATA = Path(__file__).parent / "data"
DIFFUCODER = DATA / "apple__DiffuCoder-7B-Instruct"
DREAM_CODER = DATA / "Dream-org__Dream-Coder-v0-Instruct-7B"
D3LLM_CODER = DATA / "d3LLM__d3LLM_Dream_Coder"

# The fixture's ids for the real 151643 / 151644 / 151645 / 151665 / 151666 (fixtures/dream.py), and
# DiffuCoder's <|dlm_pad|> after them.
ENDOFTEXT, IM_START, IM_END, BEGINOFTEXT, MASK = 256, 257, 258, 259, 260
DLM_PAD = 261


def _real(folder, name="config.json"):
    return json.loads((folder / name).read_text())


def _model(config):
    return dream.Model(dream.ModelArgs.from_dict(config))


@pytest.mark.parametrize("folder", [DIFFUCODER, DREAM_CODER], ids=lambda p: p.name)
def test_real_configs_build_at_full_size_with_the_right_ids(folder):
    config = _real(folder)
    assert config["model_type"] == "Dream"
    model = _model(config)
    spec = model.diffusion_spec
    assert (spec.family, spec.logit_shift, spec.mask_token_id) == ("dream", 1, 151666)
    assert spec.eos_token_ids == (151643,) and model.args.pad_token_id == 151643
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 7.0e9 < count < 8.0e9  # Qwen2.5-7B's 7.6e9, never evaluated
    if folder == DREAM_CODER:  # Qwen2.5-Coder's context and Dream's <|beginoftext|> as BOS
        assert spec.max_position_embeddings == 32768 and model.args.bos_token_id == 151665
    else:
        assert spec.max_position_embeddings == 131072 and model.args.bos_token_id == 151643


def test_defaults_are_dreams_the_diffucoder_base_recipe():
    """No file found tells these checkpoints from Dream: they decode with Dream's defaults, which
    are DiffuCoder-Base's README recipe (temperature 0.2, top_p 0.95, alg entropy, alg_temp 0,
    steps = new tokens). The instruct / cpGRPO (0.3 / 0.4) and Dream-Coder (0.1) temperatures are
    theirs to pass."""
    for folder in (DIFFUCODER, DREAM_CODER):
        model = _model(_real(folder))
        spec = model.diffusion_spec
        s = resolve_settings(spec, {"max_tokens": 256}, checkpoint_settings(model, spec))
        got = {
            k: getattr(s, k)
            for k in ("sampler", "alg", "alg_temp", "temperature", "top_p", "steps")
        }
        assert got == dict(
            sampler="dream", alg="entropy", alg_temp=0.0, temperature=0.2, top_p=0.95, steps=256
        )
        s = resolve_settings(spec, {"max_tokens": 768, "temperature": 0.1}, {})
        assert (s.temperature, s.steps, s.block_length) == (0.1, 768, 768)


def test_d3llm_dream_coder_generation_config():
    """d3LLM's distilled Dream-Coder: its generation_config.json (Dream-Coder's class defaults:
    alg origin, temperature 0, steps 512) contributes eps only, and the d3llm sampler resolves to
    the d3LLM recipe over it."""
    model = _model(_real(DREAM_CODER))
    model.generation_config = _real(D3LLM_CODER, "generation_config.json")
    spec = model.diffusion_spec
    assert checkpoint_settings(model, spec) == {"eps": 0.001}
    assert eos_ids(model, None, spec) == {151643}
    s = resolve_settings(spec, {"sampler": "d3llm"}, checkpoint_settings(model, spec))
    assert (s.threshold, s.block_size, s.max_tokens, s.temperature) == (0.5, 32, 256, 0)


def _tiny(path: Path, real: dict, specials: dict) -> Path:
    """A tiny checkpoint in the real one's layout: its config.json with the sizes (and ids) of the
    Dream fixture, the fixture's weights, a byte tokenizer with the checkpoint's special tokens."""
    config = dict(real)
    config.pop("_name_or_path", None)
    small = dream_fixture.config()
    for key in (
        "hidden_size intermediate_size num_attention_heads num_hidden_layers num_key_value_heads "
        "max_window_layers vocab_size mask_token_id eos_token_id pad_token_id torch_dtype"
    ).split():
        config[key] = small[key]
    config["bos_token_id"] = BEGINOFTEXT if real["bos_token_id"] == 151665 else ENDOFTEXT
    write_checkpoint(path, config, dream_fixture.tensors())
    build_tokenizer(path, specials, **DREAM)
    return path


def _build_diffucoder(path):
    specials = dict(dream_fixture.SPECIAL_TOKENS, **{"<|dlm_pad|>": DLM_PAD})
    return _tiny(path, _real(DIFFUCODER), specials)


def _build_dream_coder(path):
    return _tiny(path, _real(DREAM_CODER), dict(dream_fixture.SPECIAL_TOKENS))


BUILDERS = {"diffucoder": _build_diffucoder, "dream_coder": _build_dream_coder}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request, fixture_dir):
    path = build_once(fixture_dir / request.param, BUILDERS[request.param])
    return request.param, path, *load(path)


def test_eos_ids_of_each_checkpoint(tiny):
    """DiffuCoder's <|dlm_pad|> ends a row's text besides <|endoftext|>; Dream-Coder's tokenizer
    has no such token and stops at <|endoftext|> only."""
    name, _, model, tok = tiny
    want = {ENDOFTEXT, DLM_PAD} if name == "diffucoder" else {ENDOFTEXT}
    assert prepare(model, tok, [[40, 41]], {}).eos_token_ids == want
    assert model.diffusion_spec.mask_token_id == MASK


def test_a_row_ends_at_dlm_pad(fixture_dir, tmp_path):
    """A row's text ends at DiffuCoder's <|dlm_pad|>, as the README's split: the fixture's
    tokenizer names a token the run proposes mid-row <|dlm_pad|>, and the same run comes back cut
    there (the tokens before it unchanged: an EOS only ends the text, not the decoding)."""
    base = build_once(fixture_dir / "diffucoder", _build_diffucoder)
    model, tok = load(base)
    kw = dict(max_tokens=16, temperature=0.0)
    plain = batch_generate_diffusion(model, tok, [[40, 41, 42]], **kw).tokens[0]
    assert len(plain) == 16
    later = [t for i, t in enumerate(plain) if i >= 3 and t > DLM_PAD and t not in plain[:i]]
    assert later, plain
    pad = later[0]
    path = Path(shutil.copytree(base, tmp_path / "pad"))
    specials = dict(dream_fixture.SPECIAL_TOKENS, **{"<|dlm_pad|>": pad})
    build_tokenizer(path, specials, **DREAM)
    model, tok = load(path)
    assert (
        batch_generate_diffusion(model, tok, [[40, 41, 42]], **kw).tokens[0]
        == plain[: plain.index(pad)]
    )


@pytest.mark.slow
def test_plain_mlx_lm_convert_and_load(tiny, tmp_path):
    name, path, model, tok = tiny
    got = convert_and_generate(path, tmp_path / "mlx", [[40, 41, 42]], max_tokens=8, seed=1)
    cfg = got["config"]
    assert cfg["model_type"] == "Dream" and "auto_map" not in cfg
    assert (cfg["mask_token_id"], cfg["bos_token_id"]) == (
        MASK,
        BEGINOFTEXT if name == "dream_coder" else ENDOFTEXT,
    )
    assert got["module"] == "mlx_dllm_models.models.dream"
    want = batch_generate_diffusion(model, tok, [[40, 41, 42]], max_tokens=8, seed=1)
    assert got["tokens"][0] == want.tokens[0] and len(want.tokens[0]) > 0
