"""The published calls of the vision families and of MMaDA's text generation (issue 43 item 1), as
tests/test_published_calls.py holds them for the text families: the reference's own demo call (its
arguments as written, its conversation template and tokenizer call, its image through its own
preprocessing) transcribed on the fixture with the torch transcriptions of tests/reference, against
the package's defaults-equivalent call on the same question and image: the prompt ids, the window,
the tokens, the number of forwards and where it stops.

Sources (each file read at the commit named):
* LLaDA-V: ML-GSAI/LLaDA-V @ 22527697b9c7de0ea2ac16ca95b632cc1bc84966, train/generate_demo.py.
* LaViDa: jacklishufan/LaViDa @ 284ef5c4538069d65bb03bd39c3fd0ccdc2d9682, predict.py (LaViDa-LLaDA),
  eval/run_dream.sh and eval/lmms_eval/models/llava_dream.py (LaViDa-Dream).
* MMaDA: Gen-Verse/MMaDA @ 3cdb8709635beb29f66e4e23cd66060872ac3996, generate.py main().
* Dimple: yu-rp/Dimple @ 848f13285eb1528bb0fbf5c40f441077c29cd588, ReadMe.md.
* DiffusionGemma: transformers 5.25.0, models/diffusion_gemma/generation_diffusion_gemma.py
  (generate's docstring example).
Nemotron-VLM has no published call to transcribe: its remote code and model card's call were not
found (docs/families/nemotron-vlm.md).

Deliberate differences (asserted here, stated on the family's page): the LLaVA conversations of
LLaDA-V and LaViDa open with a system turn that is the demo's, not the checkpoint's template's, so
the package's chat prompt takes it only when given (`system_prompt`); generate_demo.py's dLLM-Cache
(use_cache=True, approximate) is not implemented: its use_cache=False run is the one reproduced;
MMaDA's generate.py replaces the tokenizer's chat template with its own; DiffusionGemma's example
opens no model turn.
"""

from pathlib import Path

import pytest
import torch

from fixtures import build_once
from fixtures import diffusion_gemma as gemma_fixture
from fixtures.dimple import ENDOFTEXT as DIMPLE_ENDOFTEXT
from fixtures.dimple import IM_END as DIMPLE_IM_END
from fixtures.dimple import IMAGE as DIMPLE_IMAGE
from fixtures.dimple import MASK as DIMPLE_MASK
from fixtures.dimple import build as build_dimple
from fixtures.dream import ENDOFTEXT as DREAM_ENDOFTEXT
from fixtures.dream import IM_END as DREAM_IM_END
from fixtures.dream import MASK as DREAM_MASK
from fixtures.lavida import TILE as LAVIDA_TILE
from fixtures.lavida import build_lavida, build_lavida_dream
from fixtures.llada import LLADA_TOKENS
from fixtures.llada_v import SUPPRESSED, build_llada_v
from fixtures.llada_v import TILE as LLADA_V_TILE
from fixtures.mmada import build_mmada
from helpers import cut_at_eos, random_picture, torch_logits_fn
from llava_prompt_ids import IMAGE_TOKEN_INDEX, tokenizer_image_token, with_image_markers
from mlx_dllm_models import load, stream_generate_diffusion
from mlx_dllm_models.prompts import render_chat, user_turn
from mlx_dllm_models.request import encode, prepare
from published_text import Outcome, ids_of, package_outcome
from reference import dimple_torch, lavida_torch, llada_torch, llada_v_torch

DOCS = Path(__file__).resolve().parents[1] / "docs" / "families"
# conversation.py's conv_llava_llada (LLaDA-V's "llava_llada", LaViDa's "llada"): its system turn.
LLAVA_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual "
    "content that the user provides, and assist the user with a variety of tasks using natural "
    "language."
)
MASK = LLADA_TOKENS["<|mdm_mask|>"]
EOT = LLADA_TOKENS["<|eot_id|>"]


def documented(page, phrase):
    return phrase in " ".join((DOCS / page).read_text().split())


def llava_prompt(hf, question):
    """conv.get_prompt() of a LLAMA_3-style conversation: the tokenizer's chat template over the
    system turn, the user's question, and the assistant's turn opened."""
    messages = [{"role": "system", "content": LLAVA_SYSTEM}, {"role": "user", "content": question}]
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def split_at_image(ids):
    at = ids.index(IMAGE_TOKEN_INDEX)
    return ids[:at], ids[at + 1 :]


def counting(monkeypatch, module, name):
    """Counts the calls of `module.name` (a reference's forward) in the returned list."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def package_prompt(model, processor, hf, question, image, system=None):
    """The package's chat prompt of one question and image (its image slots in place of <image>),
    rendered with the checkpoint's template as every surface renders it."""
    text = render_chat(hf, user_turn(question, system))
    return prepare(model, processor, [text], {}, images=[image]).ids[0]


def llava_demo(loaded, question, image, tile, reference, features_of):
    """(the package's prompt ids, the demo's inputs_embeds) of a LLaVA demo: the question in the
    demo's conversation through tokenizer_image_token, which the package's chat prompt with the
    demo's system turn given equals; the image through the reference's anyres preprocessing and
    `features_of(ckpt, pixels, (width, height))`, spliced at IMAGE_TOKEN_INDEX by `reference`."""
    ckpt, model, processor, hf = loaded
    published = tokenizer_image_token(llava_prompt(hf, question), hf)
    ours = package_prompt(model, processor, hf, question, image, LLAVA_SYSTEM)
    assert with_image_markers(model, ours) == published
    pixels = llada_v_torch.process_anyres_image(image, tile, _pinpoints(ckpt))
    before, after = split_at_image(published)
    features = features_of(ckpt, pixels, image.size)
    return ours, reference.embed_prompt(ckpt, before, features, after)


def checkpoint(fixture_dir, name, builder, **kw):
    """(path, model, processor, transformers' tokenizer) of a fixture, loaded by the package."""
    from transformers import AutoTokenizer

    ckpt = build_once(fixture_dir / name, builder, **kw)
    model, processor = load(ckpt)
    return ckpt, model, processor, AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=False)


def lavida_demo(loaded, question, image):
    """llava_demo with LaViDa's features (each tile pooled before the packing)."""
    features = lambda *a: lavida_torch.image_features(*a)[2]  # noqa: E731
    return llava_demo(loaded, question, image, LAVIDA_TILE, lavida_torch, features)


# ----------------------------------------------------------------------------------- LLaDA-V
# generate_demo.py: conv_templates["llava_llada"] with DEFAULT_IMAGE_TOKEN + "\nPlease describe
# the image in detail.", tokenizer_image_token, process_images (anyres), model.generate(steps=128,
# gen_length=128, block_length=128, stopping_criteria=['<|eot_id|>']), greedy low_confidence.


# The fixture as built, and with <|eot_id|> winning where token 257 would (the answer stops early).
EOT_LIKE = {"llada_v": None, "llada_v_eot257": 257}


@pytest.fixture(scope="module", params=sorted(EOT_LIKE))
def llada_v(request, fixture_dir):
    name = request.param
    return checkpoint(fixture_dir, name, build_llada_v, eot_like=EOT_LIKE[name])


@pytest.mark.slow
def test_llada_v_generate_demo(llada_v, monkeypatch):
    ckpt, model, processor, hf = llada_v
    question = "<image>\nPlease describe the image in detail."
    image = random_picture(11, (50, 90))
    reference = llada_v_torch.anyres_image_features
    ours, embeds = llava_demo(llada_v, question, image, LLADA_V_TILE, llada_v_torch, reference)
    # Without the demo's system turn (the checkpoint's template alone) the prompt is shorter.
    plain = package_prompt(model, processor, hf, question, image)
    assert len(with_image_markers(model, plain)) < len(with_image_markers(model, ours))
    forwards = counting(monkeypatch, llada_v_torch, "logits")
    want = llada_v_torch.generate_with_embeds(
        ckpt, embeds, steps=128, gen_length=128, block_length=128, mask_id=MASK,
        suppressed=SUPPRESSED, stop_ids={EOT},
    )  # fmt: skip
    theirs = Outcome(want, len(forwards), 128)
    got = package_outcome(model, processor, ours, {})
    assert got.tokens == theirs.tokens and len(got.tokens) > 2
    assert got.window == theirs.window
    assert got.forwards == theirs.forwards, (got.forwards, theirs.forwards)
    assert documented("llada-v.md", "the demo's system turn")
    assert documented("llada-v.md", "dLLM-Cache")


def _pinpoints(ckpt):
    import json

    return json.loads((Path(ckpt) / "config.json").read_text())["image_grid_pinpoints"]


# ------------------------------------------------------------------------------------ LaViDa
# predict.py: conv_templates["llada"] with DEFAULT_IMAGE_TOKEN + "\nDescribe the image in
# detail.", tokenizer_image_token (mm_utils.py, as LLaDA-V's), process_images (anyres); its first
# call generate(do_sample=False, temperature=0, max_new_tokens=64, block_length=64,
# step_ratio=1.0, prefix_lm=True) and its timed call (temperature=0.1, step_ratio=0.5,
# schedule='shift': the shift of 3 its schedule_kwargs default to). The timed call samples: its
# window and forwards are the greedy run's (the schedule does not depend on the draws), its tokens
# held at temperature 0.
LAVIDA_CALLS = {
    "first": (dict(step_ratio=1.0), {}),
    "timed": (
        dict(step_ratio=0.5, schedule="shift"),
        dict(sampler="lavida", schedule="shift", steps=32),
    ),
}


@pytest.fixture(scope="module")
def lavida(fixture_dir):
    return checkpoint(fixture_dir, "lavida", build_lavida)


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(LAVIDA_CALLS))
def test_lavida_predict(lavida, call):
    ckpt, model, processor, hf = lavida
    question = "<image>\nDescribe the image in detail."
    image = random_picture(13, (90, 150))
    ours, embeds = lavida_demo(lavida, question, image)
    arguments, settings = LAVIDA_CALLS[call]
    x, nfe = lavida_torch.generate(
        ckpt, embeds, max_new_tokens=64, block_length=64, mask_id=MASK, **arguments
    )
    # prefix_lm=True: one forward of the prompt alone (its K/V), then nfe over the answer.
    theirs = Outcome(cut_at_eos(x[0], {EOT, LLADA_TOKENS["<|endoftext|>"]}), nfe + 1, 64)
    got = package_outcome(model, processor, ours, dict(settings, temperature=0.0))
    assert got.tokens == theirs.tokens and len(got.tokens) > 2
    assert got.window == theirs.window
    assert got.forwards == theirs.forwards
    assert documented("lavida.md", "the demo's system turn")


# LaViDa-Dream: eval/run_dream.sh (--gen_kwargs alg=topk_margin,prefix_lm=True) through the
# lmms-eval wrapper eval/lmms_eval/models/llava_dream.py: conv_templates["dream"] (the same system
# turn, Dream's tokenizer's template), DEFAULT_IMAGE_TOKEN + "\n" + the question,
# tokenizer_image_token, max_new_tokens=256, temperature 0, top_p None; generate's steps (512)
# capped at max_new_tokens. Dream's loop runs a forward at every step, also where the step commits
# nothing; the package reuses that forward's logits (docs/families/dream.md).


@pytest.mark.slow
def test_lavida_dream_eval_call(fixture_dir, monkeypatch):
    loaded = checkpoint(fixture_dir, "lavida_dream", build_lavida_dream)
    ckpt, model, processor, _ = loaded
    image = random_picture(19, (90, 150))
    ours, embeds = lavida_demo(loaded, "<image>\nWhat is in the image?", image)
    canvases, answer_logits = [], lavida_torch.answer_logits

    def counted(ckpt, cache, ids):
        canvases.append(ids.clone())
        return answer_logits(ckpt, cache, ids)

    monkeypatch.setattr(lavida_torch, "answer_logits", counted)
    x = lavida_torch.dream_generate(
        ckpt, embeds, max_new_tokens=256, steps=256, mask_id=DREAM_MASK, alg="topk_margin"
    )
    repeats = sum(bool(a.equal(b)) for a, b in zip(canvases, canvases[1:]))
    # The prompt's forward (its K/V and the seed), then one a step.
    theirs = Outcome(cut_at_eos(x[0], {DREAM_IM_END, DREAM_ENDOFTEXT}), 1 + len(canvases), 256)
    got = package_outcome(model, processor, ours, {})
    assert got.tokens == theirs.tokens and len(got.tokens) > 2
    assert got.window == theirs.window
    assert got.forwards == theirs.forwards - repeats
    assert documented("dream.md", "a step that commits nothing costs no forward")


# ------------------------------------------------------------------------------------- MMaDA
# generate.py main(): its own chat template set on the tokenizer, apply_chat_template(m,
# add_generation_prompt=True, tokenize=False), tokenizer(text=prompt, padding=True,
# padding_side="left"), generate(steps=128, gen_length=128, block_length=128, temperature=1,
# cfg_scale=0., remasking='low_confidence'). Its temperature samples (Gumbel noise from torch's
# generator): the window and forwards are the sampled call's, the tokens held at temperature 0.
MMADA_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n' }}"
)


def _mmada_generate(model, spec, prompt, temperature):
    x, nfe = llada_torch.llada_generate(
        torch_logits_fn(model), torch.tensor([prompt]), steps=128, gen_length=128,
        block_length=128, temperature=temperature, cfg_scale=0.0, remasking="low_confidence",
        mask_id=spec.mask_token_id, return_nfe=True,
    )  # fmt: skip
    tokens = cut_at_eos(x[0, len(prompt) :], set(spec.eos_token_ids))
    return Outcome(tokens, nfe, x.shape[1] - len(prompt))


@pytest.mark.slow
def test_mmada_generate_py(fixture_dir):
    ckpt, model, tok, hf = checkpoint(fixture_dir, "mmada", build_mmada)
    spec = model.diffusion_spec
    messages = user_turn(
        "Lily can run 12 kilometers per hour for 4 hours. After that, she runs 6 kilometers per "
        "hour. How many kilometers can she run in 8 hours?"
    )
    hf.chat_template = MMADA_TEMPLATE
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = hf(text=text, padding=True, padding_side="left")["input_ids"]
    # The package renders the checkpoint's own template; generate.py's replaces it (one newline
    # after each header, the content trimmed): the same conversation gives other ids.
    ours = encode(tok, render_chat(tok, messages), spec.prompt_prefix)
    assert ours != prompt
    assert encode(tok, text, spec.prompt_prefix) == prompt
    assert documented("mmada.md", "generate.py replaces the tokenizer's chat template")

    torch.manual_seed(0)
    sampled = _mmada_generate(model, spec, prompt, 1.0)
    greedy = _mmada_generate(model, spec, prompt, 0.0)
    got = package_outcome(model, tok, prompt, {})
    assert (got.window, got.forwards) == (sampled.window, sampled.forwards) == (128, 128)
    mine = package_outcome(model, tok, prompt, dict(temperature=0.0))
    assert mine.tokens == greedy.tokens and len(mine.tokens) > 2
    assert mine.forwards == greedy.forwards


# ------------------------------------------------------------------------------------ Dimple
# yu-rp/Dimple @ 848f13285eb1528bb0fbf5c40f441077c29cd588, ReadMe.md's inference example (the
# model card's): processor.apply_chat_template(messages with an image part and "Describe this
# image.", add_generation_prompt=True, add_vision_id=False), processor(text, images), then
# diffusion_generate(max_new_tokens=64, steps=64, temperature=0.2, top_p=0.95, alg="origin",
# use_cache=True, alg_p_threshold=0.95, use_original_confidence=True, decoding_pipeline="dim").
# alg "origin" orders the fallback by torch's draws and the temperature samples: the window is
# the published call's, the tokens and forwards those of the same call greedy (temperature 0,
# alg maskgit_plus: the confidence's order), its other arguments as published.


def _qwen2vl_processor(processor, hf, messages, image):
    """(ids, pixel values, grid) as the README's processor builds them: the chat template's text,
    each <|image_pad|> expanded to the image's merged patches (grid.prod() // 4), tokenized; the
    pixels from transformers' Qwen2-VL image processor at the checkpoint's pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    vision = Qwen2VLImageProcessorPil(
        min_pixels=processor.min_pixels, max_pixels=processor.max_pixels
    )
    out = vision(images=[image], return_tensors="np")
    grid = out["image_grid_thw"][0]
    text = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, add_vision_id=False
    )
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // 4))
    return hf(text)["input_ids"], out["pixel_values"], grid


@pytest.mark.slow
def test_dimple_readme(fixture_dir, monkeypatch):
    ckpt, model, processor, hf = checkpoint(fixture_dir, "dimple", build_dimple)
    question, image = "Describe this image.", random_picture(17, (90, 117))
    content = [{"type": "image", "image": "demo.jpeg"}, {"type": "text", "text": question}]
    theirs_ids, pixels, grid = _qwen2vl_processor(
        processor, hf, [{"role": "user", "content": content}], image
    )
    text = render_chat(processor, user_turn(processor.image_token + question))
    ours = prepare(model, processor, [text], {}, images=[image]).ids[0]
    assert [DIMPLE_IMAGE if model.is_image_id(t) else t for t in ours] == theirs_ids

    forwards = counting(monkeypatch, dimple_torch, "_step_logits")
    want = dimple_torch.generate(
        ckpt, theirs_ids, pixels, grid, DIMPLE_MASK, 64, 64, "maskgit_plus", 0.95, use_cache=True
    )
    greedy = Outcome(cut_at_eos(want, {DIMPLE_IM_END, DIMPLE_ENDOFTEXT}), len(forwards), len(want))
    published = package_outcome(model, processor, ours, {})
    assert published.window == greedy.window == 64
    mine = package_outcome(model, processor, ours, dict(alg="maskgit_plus", temperature=0.0))
    assert mine.tokens == greedy.tokens and len(mine.tokens) > 2
    assert mine.forwards == greedy.forwards


# ---------------------------------------------------------------------------- DiffusionGemma
# transformers 5.25.0, models/diffusion_gemma/generation_diffusion_gemma.py, generate's example:
# processor.apply_chat_template(chat, tokenize=True, return_tensors="pt") (no generation prompt),
# model.generate(input_ids, max_new_tokens=512, streamer=streamer), the rest from the checkpoint's
# generation_config. Its canvases and re-noising draw from torch's generator: both sides read one
# pre-drawn sequence (diffusion_gemma_checks.Draws), so everything is compared exactly.


@pytest.mark.slow
def test_diffusion_gemma_generate_example(fixture_dir, monkeypatch):
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as gdg

    import mlx_dllm_models.engine.canvas as canvas_mod
    from diffusion_gemma_checks import Draws

    build = gemma_fixture.CHECKPOINTS["diffusion_gemma"]
    ckpt, model, processor, hf = checkpoint(fixture_dir, "diffusion_gemma", build)
    chat = [{"role": "user", "content": "Why is the sky blue?"}]
    prompt = ids_of(hf.apply_chat_template(chat, tokenize=True))
    # The example opens no model turn; the package's chat prompt does, as every surface of it
    # (and mlx-lm) renders a question: the example's ids are its prompt without that opening.
    ours = encode(processor, render_chat(processor, chat), model.diffusion_spec.prompt_prefix)
    opening = hf("<|turn>model\n", add_special_tokens=False)["input_ids"]
    assert ours == prompt + opening
    assert documented("diffusion-gemma.md", "opens no model turn")

    C, steps = gemma_fixture.CANVAS_LENGTH, 48
    draws = Draws(5, -(-512 // C), steps)
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt), dtype=torch.float32)
    calls, accept = [], gdg.EntropyBoundSampler.accept_canvas

    def counted(self, *args):
        calls.append(1)
        return accept(self, *args)

    draws.patch_torch(monkeypatch)
    monkeypatch.setattr(gdg.EntropyBoundSampler, "accept_canvas", counted)
    out = reference.eval().generate(torch.tensor([prompt]), max_new_tokens=512)
    monkeypatch.undo()
    generated = out.sequences[0, len(prompt) :].tolist()
    eos = set(gemma_fixture.EOS_IDS)
    theirs = Outcome(cut_at_eos(generated, eos), len(calls), len(generated))

    monkeypatch.setattr(canvas_mod, "CanvasNoise", lambda *a: draws.engine_noise())
    tokens, last = [], None
    for last in stream_generate_diffusion(model, processor, prompt, max_tokens=512):
        tokens.extend(last.tokens)
    assert tokens == theirs.tokens and len(tokens) > 2
    assert last.nfe == theirs.forwards  # the denoising steps: the decoder's forwards
