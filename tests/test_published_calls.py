"""Each family's published call (its README, model card or demo script: the arguments as written,
its tokenizer call and chat template), transcribed on the family's fixture with the torch
transcriptions of tests/reference, against the package's defaults-equivalent call (issue 43 item 1):
the prompt ids, the window (how many positions the canvas spans after the prompt), the tokens, the
number of forwards and where it stops.

A row names its source (repo, file). Where the published call samples (a temperature above 0), its
draws cannot be replayed through the package's own generator, so the row holds the window and the
forwards at the published arguments and the tokens at temperature 0 with the other arguments as
published. Where the package deliberately differs, the row asserts the difference and the family's
page (docs/families/*.md) says so with the reason (the phrase a row quotes is looked up there).

Covered: LLaDA, LLaDA-MoE, Dream, SDAR, SDAR-MoE, LLaDA2.0, RND1, Nemotron-Labs-Diffusion,
Fast-dLLM v2, WeDLM, CoDA, dllm's A2D (Qwen3, Qwen2), Open-dCoder, BD3-LM (its own test: every
draw replayed), Stable-DiffCoder (tests/test_stable_diffcoder.py holds its call's shape on more
prompts). The transcriptions of the newer rows are in tests/published_text.py; DiffusionGemma,
MMaDA and the vision families are in tests/test_published_calls_vision.py."""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, Optional

import pytest
import torch

import published_text as text
from block_checks import mlx_vlm_forward, transformers_forward
from fixtures import bd3lm as bd3lm_fixture
from fixtures import build_once
from fixtures import coda as coda_fixture
from fixtures import dllm as a2d_fixture
from fixtures import dllm_qwen2 as a2d_qwen2_fixture
from fixtures import dream as dream_fixture
from fixtures import fast_dllm_v2 as fast_dllm_v2_fixture
from fixtures import llada2 as llada2_fixture
from fixtures import nemotron as nemotron_fixture
from fixtures import open_dcoder as open_dcoder_fixture
from fixtures import rnd1 as rnd1_fixture
from fixtures import sdar as sdar_fixture
from fixtures import stable_diffcoder as stable_diffcoder_fixture
from fixtures import wedlm as wedlm_fixture
from fixtures.llada import CHECKPOINTS as LLADA_CHECKPOINTS
from helpers import RecordedDraws, cut_at_eos, load_fixture, torch_logits_fn
from mlx_dllm_models.decoding import llada as llada_rules
from mlx_dllm_models.decoding import stats as stats_module
from mlx_dllm_models.prompts import render_chat, user_turn
from mlx_dllm_models.request import encode
from mlx_dllm_models.settings import resolve_settings
from published_text import Outcome, ids_of, package_outcome
from reference import dream_torch, llada_torch, rnd1_sampling, sdar_generate
from reference.llada2_generate import llada20_generate

DOCS = Path(__file__).resolve().parents[1] / "docs" / "families"
QUESTION = "What is two plus two?"


@dataclass(frozen=True)
class Call:
    source: str  # repo, file
    build: Callable
    tokenize: Callable  # (HF tokenizer, messages) -> ids, as the published call tokenizes
    published: Callable  # (path, model, spec, prompt ids) -> Outcome at the published arguments
    greedy: Optional[Callable] = None  # the same at temperature 0, when the published call samples
    # What the package's call sets for that greedy reading.
    greedy_settings: Dict = field(default_factory=lambda: {"temperature": 0.0})
    package: Dict = field(default_factory=dict)  # the package's call: what it sets beyond defaults
    # The package's forwards against the published call's, and why they may differ.
    forwards: Callable = lambda ours, theirs: ours.forwards == theirs.forwards
    differs: Dict = field(default_factory=dict)  # resolved default -> (published value, docs page)
    documented: tuple = ()  # (docs page, phrase): where a deliberate difference is stated
    # The chat template's arguments mlx-lm's tokenizer wrapper gives the real checkpoint's
    # vocabulary, where the fixture's small one reads otherwise.
    template: Dict = field(default_factory=dict)
    text: Optional[str] = None  # a call without a chat template: the prompt text it tokenizes


def _dict_ids(hf, messages):
    """apply_chat_template(return_tensors="pt", return_dict=True, add_generation_prompt=True)."""
    return hf.apply_chat_template(
        messages, return_tensors="pt", return_dict=True, add_generation_prompt=True
    )["input_ids"][0].tolist()


def _templated(hf, messages, **kw):
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)


# ------------------------------------------------------------------------------------- LLaDA
# ML-GSAI/LLaDA generate.py main(): the template rendered as text, tokenized with
# add_special_tokens=False; generate(steps=128, gen_length=128, block_length=32, temperature=0.,
# cfg_scale=0., remasking='low_confidence').


def _llada(path, model, spec, prompt):
    """LLaDA's generate.py main(), and LLaDA-MoE's model card, which copies it with its own ids."""
    x, nfe = llada_torch.llada_generate(
        torch_logits_fn(model),
        torch.tensor([prompt]),
        steps=128,
        gen_length=128,
        block_length=32,
        temperature=0.0,
        cfg_scale=0.0,
        remasking="low_confidence",
        mask_id=spec.mask_token_id,
        return_nfe=True,
    )
    tokens = cut_at_eos(x[0, len(prompt) :], set(spec.eos_token_ids))
    return Outcome(tokens, nfe, x.shape[1] - len(prompt))


# ------------------------------------------------------------------------------------- Dream
# DreamLM/Dream README.md: apply_chat_template(messages, return_tensors="pt", return_dict=True,
# add_generation_prompt=True); diffusion_generate(max_new_tokens=512, steps=512,
# temperature=0.2, top_p=0.95, alg="entropy", alg_temp=0.). max_new_tokens = steps = the package's
# max_tokens (128) here: one token a step over one canvas as published, at a fixture's cost.


def _dream_run(model, spec, prompt, temperature):
    forward = torch_logits_fn(model)
    calls = []

    def counted(x, attention_mask, tok_idx):
        calls.append(x.clone())
        return forward(x)

    seq = dream_torch.dream_generate(
        counted,
        [prompt],
        max_new_tokens=128,
        steps=128,
        alg="entropy",
        alg_temp=0.0,
        temperature=temperature,
        top_p=0.95,
        mask_token_id=spec.mask_token_id,
    )
    tokens = cut_at_eos(seq[0, len(prompt) :], set(spec.eos_token_ids))
    repeats = sum(bool(torch.equal(a, b)) for a, b in zip(calls, calls[1:]))
    return Outcome(tokens, len(calls), seq.shape[1] - len(prompt), repeats)


# -------------------------------------------------------------------------------------- SDAR
# JetAstra/SDAR generate.py: the template rendered as text, batch_encode_plus(...,
# add_special_tokens=False); block_diffusion_generate(block_length=4, denoising_steps=4,
# temperature=1.0, top_k=0, top_p=1.0, remasking_strategy="low_confidence_dynamic",
# confidence_threshold=0.85, stopping_criteria_idx=generation_config's eos); gen_length is the
# package's max_tokens (generate.py's 20480 is past the fixture's context).


def _sdar_run(path, spec, prompt, temperature):
    x, forwards = sdar_generate.sdar_generate(
        transformers_forward(path),
        torch.tensor([prompt]),
        spec.mask_token_id,
        gen_length=128,
        block_length=4,
        denoising_steps=4,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        remasking_strategy="low_confidence_dynamic",
        confidence_threshold=0.85,
        stopping_criteria_idx=sorted(spec.eos_token_ids),
    )
    generated = x[0, len(prompt) : len(prompt) + 128]
    window = x.shape[1] - len(prompt)  # whole blocks of 4, the last cut after 128 tokens
    return Outcome(cut_at_eos(generated, set(spec.eos_token_ids)), forwards, window)


# ----------------------------------------------------------------------------------- LLaDA2.0
# inclusionAI LLaDA2.0-mini model card: apply_chat_template(add_generation_prompt=True,
# tokenize=True); generate(gen_length=512, block_length=32, steps=32, temperature=0.0) with the
# remote code's threshold default 0.95. gen_length is the package's max_tokens here.


def _llada2(path, model, spec, prompt):
    want, forwards = llada20_generate(
        mlx_vlm_forward(path),
        torch.tensor([prompt]),
        temperature=0.0,
        block_length=32,
        steps=32,
        gen_length=128,
        threshold=0.95,
        eos_id=spec.eos_token_ids[0],
        mask_id=spec.mask_token_id,
    )
    window = -(-(len(prompt) + 128) // 32) * 32 - len(prompt)  # whole blocks, the last cut
    return Outcome(cut_at_eos(want, set(spec.eos_token_ids)), forwards, window)


# --------------------------------------------------------------------------------------- RND1
# RadicalNumerics/RND1 README.md: generate(inputs=input_ids, max_new_tokens=256,
# num_diffusion_steps=256), sampled at the temperature the family page records (0.01); the prompt
# through the chat template and tokenizer(text). With an EOS id set (RND1GenerationMixin always
# sets one), the window is max_new_tokens positions, the last kept as the pad: 255 masks. The
# package's greedy reading is the reference's greedy=True at temperature 1 (tests/test_rnd1.py).


def _rnd1_run(model, spec, prompt, temperature, greedy):
    seq, nfe = rnd1_sampling.generate(
        torch_logits_fn(model),
        prompt,
        256,
        256,
        mask_token_id=spec.mask_token_id,
        eos_token_id=rnd1_fixture.IM_END,
        pad_token_id=rnd1_fixture.ENDOFTEXT,
        greedy=greedy,
        temperature=temperature,
    )
    assert seq[-1] == rnd1_fixture.ENDOFTEXT
    tokens = cut_at_eos(seq[len(prompt) : -1], set(spec.eos_token_ids))
    return Outcome(tokens, nfe, len(seq) - len(prompt))


SDAR_CALL = Call(
    source="JetAstra/SDAR generate.py",
    build=sdar_fixture.build_sdar,
    tokenize=lambda hf, m: hf([_templated(hf, m)], add_special_tokens=False)["input_ids"][0],
    published=lambda path, model, spec, p: _sdar_run(path, spec, p, 1.0),
    greedy=lambda path, model, spec, p: _sdar_run(path, spec, p, 0.0),
    package=dict(max_tokens=128, threshold=0.85),
    # The reference's cache costs one store forward per finished block; the package folds
    # that commit into the next block's first forward.
    forwards=lambda ours, theirs: ours.forwards <= theirs.forwards,
    differs=dict(threshold=(0.85, "sdar.md"), temperature=(1.0, "sdar.md")),
    documented=(("sdar.md", "one store forward per finished block fewer"),),
)


CALLS = {
    "llada": Call(
        source="ML-GSAI/LLaDA generate.py",
        build=LLADA_CHECKPOINTS["llada"],
        tokenize=lambda hf, m: hf(_templated(hf, m), add_special_tokens=False)["input_ids"],
        published=_llada,
        package=dict(max_tokens=128),
    ),
    "llada_moe": Call(
        source="inclusionAI/LLaDA-MoE-7B-A1B-Instruct README.md (model card)",
        build=LLADA_CHECKPOINTS["llada_moe"],
        tokenize=lambda hf, m: hf(_templated(hf, m))["input_ids"],
        published=_llada,
        package=dict(max_tokens=128),
    ),
    "dream": Call(
        source="DreamLM/Dream README.md",
        build=dream_fixture.build,
        tokenize=_dict_ids,
        published=lambda path, model, spec, p: _dream_run(model, spec, p, 0.2),
        greedy=lambda path, model, spec, p: _dream_run(model, spec, p, 0.0),
        package=dict(max_tokens=128),
        # A step that commits nothing leaves the canvas as it was: the package reuses that
        # forward's logits where the reference runs it again.
        forwards=lambda ours, theirs: ours.forwards == theirs.forwards - theirs.repeats,
        documented=(("dream.md", "a step that commits nothing costs no forward"),),
    ),
    "rnd1": Call(
        source="RadicalNumerics/RND1 README.md",
        build=rnd1_fixture.build,
        tokenize=lambda hf, m: hf(_templated(hf, m))["input_ids"],
        published=lambda path, model, spec, p: _rnd1_run(model, spec, p, 0.01, False),
        greedy=lambda path, model, spec, p: _rnd1_run(model, spec, p, 1.0, True),
        # max_tokens N is the reference's max_new_tokens=N: N - 1 masks and the reserved pad.
        package=dict(max_tokens=256),
    ),
    "sdar": SDAR_CALL,
    "sdar_moe": replace(
        SDAR_CALL,
        source="JetAstra/SDAR generate.py (its one script for every SDAR checkpoint, MoE included)",
        build=sdar_fixture.build_sdar_moe,
    ),
    "llada2": Call(
        source="inclusionAI/LLaDA2.0-mini README.md (model card)",
        build=llada2_fixture.build,
        tokenize=lambda hf, m: ids_of(hf.apply_chat_template(m, add_generation_prompt=True)),
        published=_llada2,
        package=dict(max_tokens=128),
        # The package's prefix cache encodes the prompt's whole blocks once (the prompt here
        # spans one); the reference recomputes the window at every step instead.
        forwards=lambda ours, theirs: ours.forwards == theirs.forwards + 1,
        documented=(("llada2.md", "one prefill forward more than the reference's count"),),
    ),
    "nemotron": Call(
        source="nvidia/Nemotron-Labs-Diffusion-8B README.md (model card; its chat.py's dlm mode)",
        build=nemotron_fixture.build,
        tokenize=lambda hf, m: hf(_templated(hf, m)).input_ids,
        # max_new_tokens 512 is past the fixture's context of 64: 40, whole blocks of its 8.
        published=lambda path, model, spec, p: text.nemotron_run(
            nemotron_fixture.mlx_vlm_model(path), spec, p, nemotron_fixture.BLOCK_SIZE, 40
        ),
        package=dict(max_tokens=40),
    ),
    "fast_dllm_v2": Call(
        source="Efficient-Large-Model/Fast_dLLM_v2_7B README.md (model card)",
        build=fast_dllm_v2_fixture.build,
        tokenize=lambda hf, m: hf([_templated(hf, m)], return_tensors="pt")["input_ids"][
            0
        ].tolist(),
        published=lambda path, model, spec, p: text.fast_dllm_v2_run(path, spec, p),
    ),
    "wedlm": Call(
        source="Tencent/WeDLM README.md (Python API)",
        build=wedlm_fixture.build,
        tokenize=lambda hf, m: hf.encode(_templated(hf, m)),
        published=lambda path, model, spec, p: text.wedlm_run(path, spec, p),
    ),
    "coda": Call(
        source="SalesforceAIResearch/CoDA serving/fast-api/app/core/service.py, config.py",
        build=coda_fixture.build,
        tokenize=_dict_ids,
        published=lambda path, model, spec, p: text.coda_run(path, spec, p, 0.1),
        greedy=lambda path, model, spec, p: text.coda_run(path, spec, p, 0.0),
        greedy_settings=dict(alg_temp=0.0),
        # CoDA's Qwen3 vocabulary holds <think>: mlx-lm passes enable_thinking=True, as the
        # template's own default reads (the fixture's has no <think>, so the wrapper says False).
        template=dict(enable_thinking=True),
    ),
    # The Qwen3 vocabulary holds <think> (mlx-lm passes enable_thinking=True); Qwen2.5-Coder's
    # template has no thinking switch. The fixtures share a Qwen3 template and no <think>.
    **{
        name: Call(
            source="ZHZisZZ/dllm @ ca17675 examples/a2d/mdlm/sample.py",
            build=build,
            tokenize=lambda hf, m: ids_of(hf.apply_chat_template(m, add_generation_prompt=True)),
            published=lambda path, model, spec, p: text.a2d_run(path, spec, p),
            template=dict(enable_thinking=True),
        )
        for name, build in (
            ("a2d_qwen3", a2d_fixture.build),
            ("a2d_qwen2", a2d_qwen2_fixture.build),
        )
    },
    "open_dcoder": Call(
        source="pengzhangzhi/Open-dLLM @ ea477d6 sample.py",
        build=open_dcoder_fixture.build_converted,
        tokenize=lambda hf, t: hf(t).input_ids,
        text=text.SAMPLE_PY_PROMPT,
        published=lambda path, model, spec, p: text.open_dcoder_run(path, spec, p, 0.5),
        greedy=lambda path, model, spec, p: text.open_dcoder_run(path, spec, p, 0.0),
    ),
    "stable_diffcoder": Call(
        source="ByteDance-Seed/Stable-DiffCoder README.md",
        build=stable_diffcoder_fixture.build_converted,
        tokenize=lambda hf, m: hf(_templated(hf, m))["input_ids"],
        published=lambda path, model, spec, p: text.stable_diffcoder_run(path, spec, p),
        package=dict(max_tokens=128),
        # generate_block counts a store forward per finished block and no prefill; the package
        # folds each store into the next block's first forward and encodes the prompt's whole
        # blocks once.
        forwards=lambda ours, theirs: ours.forwards == theirs.forwards - theirs.stores + 1,
        documented=(("stable-diffcoder.md", "folds each finished block's store forward"),),
    ),
}


@pytest.fixture(scope="module")
def family(fixture_dir):
    loaded = {}

    def get(name):
        if name not in loaded:
            path = build_once(fixture_dir / f"published_{name}", CALLS[name].build)
            loaded[name] = (path, *load_fixture(path))
        return loaded[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CALLS))
def test_published_call(family, name):
    call = CALLS[name]
    path, model, tok = family(name)
    spec = model.diffusion_spec
    from transformers import AutoTokenizer

    messages = user_turn(QUESTION) if call.text is None else call.text
    prompt = list(call.tokenize(AutoTokenizer.from_pretrained(str(path)), messages))
    # The package's prompt (its chat prompt, or the text as given) is the published call's ids.
    rendered = render_chat(tok, messages, call.template) if call.text is None else call.text
    assert encode(tok, rendered, spec.prompt_prefix) == prompt

    theirs = call.published(path, model, spec, prompt)
    ours = package_outcome(model, tok, prompt, call.package)
    assert ours.window == theirs.window
    if call.greedy is None:
        assert ours.tokens == theirs.tokens
        assert call.forwards(ours, theirs), (ours.forwards, theirs.forwards)
    else:
        greedy = call.greedy(path, model, spec, prompt)
        mine = package_outcome(model, tok, prompt, dict(call.package, **call.greedy_settings))
        assert mine.tokens == greedy.tokens
        assert call.forwards(mine, greedy), (mine.forwards, greedy.forwards, greedy.repeats)

    resolved = resolve_settings(spec, {})
    for setting, (published, page) in call.differs.items():
        assert getattr(resolved, setting) != published
        text = (DOCS / page).read_text()
        assert f"{setting} {published}" in text or f"{setting}={published}" in text, setting
    for page, phrase in call.documented:
        assert phrase in " ".join((DOCS / page).read_text().split()), (page, phrase)


@pytest.mark.slow
def test_bd3lms_published_sampling(fixture_dir, monkeypatch):
    """BD3-LM's README call (published_text.bd3lm_run) samples every token and position: the
    package's draws are recorded and replayed to the reference. Unconditional generation is the
    package's empty prompt, read as the BOS; model.length L is max_tokens L - 1 after it."""
    path = build_once(fixture_dir / "published_bd3lm", bd3lm_fixture.build)
    model, tok = load_fixture(path)
    bos, length = bd3lm_fixture.ENDOFTEXT, bd3lm_fixture.LENGTH
    assert encode(tok, "", model.diffusion_spec.prompt_prefix) == [bos]
    draws = RecordedDraws(seed=43)
    monkeypatch.setattr(stats_module, "uniform", draws.ours_tokens)
    monkeypatch.setattr(llada_rules, "random_confidence", draws.ours_positions)
    ours = package_outcome(model, tok, [bos], dict(max_tokens=length - 1))
    theirs = text.bd3lm_run(path, bos, length, draws)
    assert (ours.tokens, ours.window) == (theirs.tokens, theirs.window)
    assert len(ours.tokens) > length // 2 and draws.made == ours.forwards
    assert ours.forwards == theirs.forwards, (ours.forwards, theirs.forwards)
