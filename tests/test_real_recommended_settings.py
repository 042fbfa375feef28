"""The decoding settings resolved from real checkpoints' files (tests/data, see its README) against
the ones the upstream model cards, READMEs and demo scripts recommend.

For each checkpoint whose config.json was found, its model is built without allocating weights,
given the real generation_config.json (and, for LLaDA2.x, the parameter names of its remote
`generate`), and the package's settings resolved from them are compared, one setting at a time,
with the upstream value: a strict xfail where the package keeps another value on purpose (the
reason says why), so that a fix shows up.
"""

from functools import lru_cache

import pytest

from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import resolve_settings
from real_checkpoints import NOT_FOUND, built, load_json, require


def _xfail(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


# DiffuCoder and Dream-Coder are Dream checkpoints: no file found tells them from Dream, so they
# decode with Dream's defaults (temperature 0.2, DiffuCoder-Base's README value; 128 tokens).
DIFFUCODER_TEMPERATURE = (
    "apple/ml-diffucoder inference_demo.py uses temperature 0.3 (README cpGRPO example 0.4); the "
    "package keeps Dream's 0.2: DiffuCoder's config.json is Dream's, and its generation_config.json "
    "was not found"
)
DREAM_CODER_TEMPERATURE = (
    "DreamLM/Dream-Coder README uses temperature 0.1; the package keeps Dream's 0.2 (config.json "
    "is Dream's, generation_config.json was not found)"
)
CODER_MAX_TOKENS = "the coders' READMEs generate 256 / 768 tokens; the package keeps Dream's 128"
DREAM_README = (
    "DreamLM/Dream README (Instruct example): max_new_tokens=512 with steps=512; the package keeps "
    "its max_tokens default of 128 (and steps follow max_tokens, so the recipe's one token per "
    "step holds)"
)

# Parameter names of LLaDA2MoeModelLM.generate in the checkpoints' own modeling_llada2_moe.py
# (read with loader.remote_generate_params from Xenearkr/DARE: LLaDA2.0-mini's blob 3d29a17 at
# 7016e0e, LLaDA2.1-mini's blob 55de70f at 5877371; the code itself is not kept here). config.json
# and the tokenizer files of the two are byte-identical; this is what tells them apart.
REMOTE_GENERATE_PARAMS = {
    "inclusionAI__LLaDA2.0-mini": frozenset(
        "self inputs temperature block_length steps gen_length top_p top_k eos_early_stop "
        "minimal_topk threshold eos_id mask_id".split()
    ),
    "inclusionAI__LLaDA2.1-mini": frozenset(
        "self inputs temperature block_length steps gen_length top_p top_k eos_early_stop "
        "minimal_topk threshold editing_threshold max_post_steps eos_id mask_id "
        "num_to_transfer".split()
    ),
}

# (checkpoint, setting, value recommended upstream, xfail reason when the package differs)
SETTINGS = [
    # LLaDA generate.py main(): gen_length=128, steps=128 over 4 blocks of 32, temperature 0,
    # remasking 'low_confidence' (= quota).
    ("GSAI-ML__LLaDA-8B-Instruct", "sampler", "quota", None),
    ("GSAI-ML__LLaDA-8B-Instruct", "block_length", 32, None),
    ("GSAI-ML__LLaDA-8B-Instruct", "steps", 32, None),
    ("GSAI-ML__LLaDA-8B-Instruct", "temperature", 0.0, None),
    ("GSAI-ML__LLaDA-8B-Instruct", "max_tokens", 128, None),
    # Dream README (Instruct example): diffusion_generate(max_new_tokens=512, steps=512,
    # temperature=0.2, top_p=0.95, alg="entropy", alg_temp=0.): steps = new tokens. The
    # checkpoint's generation_config.json (alg origin, steps 512, temperature 0) is not read for
    # these (models/dream.py says why).
    ("Dream-org__Dream-v0-Instruct-7B", "sampler", "dream", None),
    ("Dream-org__Dream-v0-Instruct-7B", "steps", 128, None),  # = max_tokens
    ("Dream-org__Dream-v0-Instruct-7B", "eps", 0.001, None),
    ("Dream-org__Dream-v0-Instruct-7B", "alg", "entropy", None),
    ("Dream-org__Dream-v0-Instruct-7B", "alg_temp", 0.0, None),
    ("Dream-org__Dream-v0-Instruct-7B", "temperature", 0.2, None),
    ("Dream-org__Dream-v0-Instruct-7B", "top_p", 0.95, None),
    ("Dream-org__Dream-v0-Instruct-7B", "max_tokens", 512, DREAM_README),
    # SDAR README: "greedy decoding with block_length = 4, denoising_steps = 4".
    ("JetLM__SDAR-8B-Chat", "block_length", 4, None),
    ("JetLM__SDAR-8B-Chat", "steps", 4, None),
    ("JetLM__SDAR-8B-Chat", "temperature", 0.0, None),
    ("JetLM__SDAR-8B-Chat", "sampler", "threshold", None),
    ("JetLM__SDAR-8B-Chat", "top_k", None, None),  # generation_config's AR top_k 20 is not read
    ("JetLM__SDAR-8B-Chat", "top_p", None, None),
    # SDAR README: JetEngine (dynamic_threshold=0.9) and LMDeploy (dllm_confidence_threshold=0.9,
    # greedy) examples; generate.py's script default is 0.85.
    ("JetLM__SDAR-8B-Chat", "threshold", 0.9, None),
    # SDAR-VL generate.py's demo call: block_length = denoising_steps = 4, low_confidence_static.
    ("JetLM__SDAR-VL-4B", "block_length", 4, None),
    ("JetLM__SDAR-VL-4B", "steps", 4, None),
    ("JetLM__SDAR-VL-4B", "sampler", "quota", None),
    ("JetLM__SDAR-VL-4B", "temperature", 0.0, None),
    ("JetLM__SDAR-30B-A3B-Chat", "block_length", 4, None),
    ("JetLM__SDAR-30B-A3B-Chat", "steps", 4, None),
    ("JetLM__SDAR-30B-A3B-Chat", "temperature", 0.0, None),
    ("JetLM__SDAR-30B-A3B-Chat", "sampler", "threshold", None),
    ("JetLM__SDAR-30B-A3B-Chat", "threshold", 0.9, None),
    # LLaDA2.0-mini model card: temperature 0.0, block_length 32, steps 32 (generate's threshold
    # default 0.95); "we recommend using an output length of 32768 tokens".
    ("inclusionAI__LLaDA2.0-mini", "block_length", 32, None),
    ("inclusionAI__LLaDA2.0-mini", "steps", 32, None),
    ("inclusionAI__LLaDA2.0-mini", "temperature", 0.0, None),
    ("inclusionAI__LLaDA2.0-mini", "sampler", "threshold", None),
    ("inclusionAI__LLaDA2.0-mini", "threshold", 0.95, None),
    ("inclusionAI__LLaDA2.0-mini", "editing_threshold", None, None),
    ("inclusionAI__LLaDA2.0-mini", "editing_mode", "off", None),
    (
        "inclusionAI__LLaDA2.0-mini",
        "max_tokens",
        32768,
        "LLaDA2.0-mini model card: 'We recommend using an output length of 32768 tokens'; "
        "the package default is 128",
    ),
    ("inclusionAI__LLaDA2.1-mini", "block_length", 32, None),
    ("inclusionAI__LLaDA2.1-mini", "temperature", 0.0, None),
    ("inclusionAI__LLaDA2.1-mini", "top_p", None, None),
    ("inclusionAI__LLaDA2.1-mini", "top_k", None, None),
    # LLaDA2.1-mini model card, Best Practices: Quality Mode threshold=0.7, editing_threshold=0.5,
    # max_post_steps 16 (Speed Mode: 0.5 / 0.0, editing_mode="speed").
    ("inclusionAI__LLaDA2.1-mini", "max_post_steps", 16, None),
    ("inclusionAI__LLaDA2.1-mini", "editing_mode", "quality", None),
    ("inclusionAI__LLaDA2.1-mini", "threshold", 0.7, None),
    ("inclusionAI__LLaDA2.1-mini", "editing_threshold", 0.5, None),
    (
        "inclusionAI__LLaDA2.1-mini",
        "max_tokens",
        16384,
        "LLaDA2.1-mini model card: 'We recommend using an output length of 16384 tokens'; "
        "the package default is 128",
    ),
    # Nemotron-Labs-Diffusion: NVlabs README's confidence-thresholded unmasking at 0.9 (vLLM's and
    # mlx-vlm's diffusion-mode default too), blocks of config.block_size (32), greedy; diffusion
    # mode with the AR-seeded first token (the remote generate's causal_context=True).
    ("nvidia__Nemotron-Labs-Diffusion-3B", "sampler", "threshold", None),
    ("nvidia__Nemotron-Labs-Diffusion-3B", "threshold", 0.9, None),
    ("nvidia__Nemotron-Labs-Diffusion-3B", "block_length", 32, None),
    ("nvidia__Nemotron-Labs-Diffusion-3B", "temperature", 0.0, None),
    ("nvidia__Nemotron-Labs-Diffusion-3B", "causal_context", True, None),
    ("nvidia__Nemotron-Labs-Diffusion-8B", "sampler", "threshold", None),
    ("nvidia__Nemotron-Labs-Diffusion-8B", "threshold", 0.9, None),
    ("nvidia__Nemotron-Labs-Diffusion-8B", "block_length", 32, None),
    ("nvidia__Nemotron-Labs-Diffusion-8B", "mode", "diffusion", None),
    # DiffusionGemma: its generation_config.json (transformers' convert script writes the same):
    # 256 new tokens, 48 denoising steps, entropy bound 0.1, temperatures 0.8 -> 0.4, stop once
    # stable for 1 step with mean entropy < 0.005; every canvas the trained canvas_length 256.
    ("google__diffusiongemma-26B-A4B-it", "sampler", "entropy", None),
    ("google__diffusiongemma-26B-A4B-it", "entropy_bound", 0.1, None),
    ("google__diffusiongemma-26B-A4B-it", "max_tokens", 256, None),
    ("google__diffusiongemma-26B-A4B-it", "max_denoising_steps", 48, None),
    ("google__diffusiongemma-26B-A4B-it", "t_min", 0.4, None),
    ("google__diffusiongemma-26B-A4B-it", "t_max", 0.8, None),
    ("google__diffusiongemma-26B-A4B-it", "stability_threshold", 1, None),
    ("google__diffusiongemma-26B-A4B-it", "confidence_threshold", 0.005, None),
    ("google__diffusiongemma-26B-A4B-it", "min_canvas_length", 256, None),
    ("google__diffusiongemma-26B-A4B-it", "max_canvas_length", 256, None),
    # CoDA's deployment recipe (README / serving config.py): 256 tokens, 128 steps, temperature 0,
    # alg entropy, alg_temp 0.1; its generation_config.json's alg 'original' is never read.
    ("Salesforce__CoDA-v0-Instruct", "sampler", "dream", None),
    ("Salesforce__CoDA-v0-Instruct", "max_tokens", 256, None),
    ("Salesforce__CoDA-v0-Instruct", "steps", 128, None),
    ("Salesforce__CoDA-v0-Instruct", "temperature", 0.0, None),
    ("Salesforce__CoDA-v0-Instruct", "alg", "entropy", None),
    ("Salesforce__CoDA-v0-Instruct", "alg_temp", 0.1, None),
    # RND1's README / demo: generate(max_new_tokens=256, num_diffusion_steps=256, temperature=0.01).
    ("radicalnumerics__RND1-Base-0910", "sampler", "rnd1", None),
    ("radicalnumerics__RND1-Base-0910", "max_tokens", 256, None),
    ("radicalnumerics__RND1-Base-0910", "steps", 256, None),
    ("radicalnumerics__RND1-Base-0910", "temperature", 0.01, None),
    # DiffuCoder-7B-Instruct: apple/ml-diffucoder inference_demo.py, diffusion_generate(
    # max_new_tokens=256, steps=256, temperature=0.3, top_p=0.95, alg="entropy", alg_temp=0.).
    ("apple__DiffuCoder-7B-Instruct", "sampler", "dream", None),
    ("apple__DiffuCoder-7B-Instruct", "alg", "entropy", None),
    ("apple__DiffuCoder-7B-Instruct", "alg_temp", 0.0, None),
    ("apple__DiffuCoder-7B-Instruct", "top_p", 0.95, None),
    ("apple__DiffuCoder-7B-Instruct", "temperature", 0.3, DIFFUCODER_TEMPERATURE),
    ("apple__DiffuCoder-7B-Instruct", "max_tokens", 256, CODER_MAX_TOKENS),
    # Dream-Coder README: diffusion_generate(max_new_tokens=768, steps=768, temperature=0.1,
    # top_p=0.95, alg="entropy", alg_temp=0.).
    ("Dream-org__Dream-Coder-v0-Instruct-7B", "sampler", "dream", None),
    ("Dream-org__Dream-Coder-v0-Instruct-7B", "alg", "entropy", None),
    ("Dream-org__Dream-Coder-v0-Instruct-7B", "alg_temp", 0.0, None),
    ("Dream-org__Dream-Coder-v0-Instruct-7B", "top_p", 0.95, None),
    ("Dream-org__Dream-Coder-v0-Instruct-7B", "temperature", 0.1, DREAM_CODER_TEMPERATURE),
    ("Dream-org__Dream-Coder-v0-Instruct-7B", "max_tokens", 768, CODER_MAX_TOKENS),
]


def _settings_params():
    for name, setting, value, reason in SETTINGS:
        marks = [_xfail(reason)] if reason else []
        yield pytest.param(name, setting, value, marks=marks, id=f"{name}-{setting}")
    for name in sorted(NOT_FOUND):
        yield pytest.param(name, None, None, id=f"{name}-all")


@lru_cache(maxsize=None)
def _resolved(name):
    _, model, spec = built(name)
    model.generation_config = load_json(name, "generation_config.json") or {}
    model.remote_generate_params = REMOTE_GENERATE_PARAMS.get(name, frozenset())
    return resolve_settings(spec, {}, checkpoint_settings(model, spec))


@pytest.mark.parametrize("name,setting,value", list(_settings_params()))
def test_settings_from_real_generation_config(name, setting, value):
    require(name, "config.json")
    resolved = _resolved(name)
    assert resolved.has(setting), f"{setting} is not a setting of this family"
    assert getattr(resolved, setting) == value
