"""The published calls' transcriptions that tests/test_published_calls.py and
tests/test_published_calls_vision.py compare with the package: what each returns (Outcome), the
package's own call recorded the same way (package_outcome), and the text families' runs at their
published arguments."""

from dataclasses import dataclass

import torch

from helpers import cut_at_eos, spy_forwards
from mlx_dllm_models import stream_generate_diffusion


@dataclass
class Outcome:
    tokens: list  # generated, cut before the first EOS
    forwards: int
    window: int  # positions after the prompt that the canvas spans
    repeats: int = 0  # forwards over the same canvas as the forward before (nothing committed)
    stores: int = 0  # forwards that only store a finished block's K/V


def ids_of(encoded):
    """apply_chat_template(tokenize=True)'s ids: a list, or a BatchEncoding in newer transformers."""
    return encoded if isinstance(encoded, list) else encoded["input_ids"]


def package_outcome(model, tok, prompt, settings):
    """The package's call on a prompt's ids: its tokens, forwards and window (the widest span a
    forward covers, cache included, past the prompt)."""
    spans, tokens, last = [], [], None

    def record(inputs, cache, mask, head_span):
        offset = cache[0].offset if cache and cache[0] is not None else 0
        spans.append(int(offset) + inputs.shape[1])

    with spy_forwards(model, record):
        for last in stream_generate_diffusion(model, tok, prompt, **settings):
            tokens.extend(last.tokens)
    return Outcome(tokens, last.nfe, max(spans) - len(prompt))


def spans(forward, span):
    """`forward` wrapped so that each call's reach (`span(*args, **kw)`: the position after the
    last one it covers) is recorded; (the wrapper, the list of reaches)."""
    seen = []

    def wrapped(*args, **kw):
        seen.append(span(*args, **kw))
        return forward(*args, **kw)

    return wrapped, seen


# ------------------------------------------------------------------------ Nemotron-Labs-Diffusion
# The model card's snippet (huggingface.co/nvidia/Nemotron-Labs-Diffusion-8B, as mirrored by its
# chat.py "dlm" mode): apply_chat_template(tokenize=False, add_generation_prompt=True), then
# tokenizer(prompt).input_ids; model.generate(prompt_ids, max_new_tokens=512, block_length=32,
# threshold=0.9, eos_token_id=tokenizer.eos_token_id). block_length is the fixture's block_size.


def nemotron_run(vlm, spec, prompt, block_length, max_new_tokens=512):
    from reference.nemotron_reference import VlmForward, hf_generate

    def reach(ids, past_key_values=None, **kw):
        return (past_key_values[0].offset if past_key_values else 0) + ids.shape[1]

    forward, seen = spans(VlmForward(vlm), reach)
    x, nfe = hf_generate(
        forward,
        [prompt],
        max_new_tokens,
        block_length,
        spec.mask_token_id,
        spec.eos_token_ids[0],
        threshold=0.9,
    )
    tokens = cut_at_eos(x[0, len(prompt) :], set(spec.eos_token_ids))
    return Outcome(tokens, nfe, max(seen) - len(prompt))


# ------------------------------------------------------------------------------------ Fast-dLLM v2
# Efficient-Large-Model/Fast_dLLM_v2_7B README.md (model card): apply_chat_template(messages,
# tokenize=False, add_generation_prompt=True), tokenizer([text], return_tensors="pt");
# model.generate(input_ids, tokenizer=tokenizer, max_new_tokens=512, small_block_size=8,
# threshold=0.9): block_size the remote default 32, the stop token the tokenizer's EOS, no
# use_block_cache, greedy.


def fast_dllm_v2_run(path, spec, prompt):
    from reference.fast_dllm_v2_torch import Reference, generate

    ref = Reference(path)

    def reach(ids, past=None, *args, **kw):
        return (past[0][0].shape[2] if past else 0) + ids.shape[1]

    ref.forward, seen = spans(ref.forward, reach)
    stop = spec.eos_token_ids[0]
    x, nfe = generate(
        ref,
        torch.tensor([prompt]),
        512,
        spec.mask_token_id,
        threshold=0.9,
        small_block_size=8,
        block_size=32,
        stop_token=stop,
    )
    return Outcome(cut_at_eos(x[0, len(prompt) :], {stop}), nfe, max(seen) - len(prompt))


# ------------------------------------------------------------------------------------------ WeDLM
# Tencent/WeDLM README.md, "Python API": tokenizer.apply_chat_template(messages, tokenize=False,
# add_generation_prompt=True); llm.generate([text], SamplingParams(temperature=0.0,
# max_tokens=512)), the engine's defaults otherwise (window 16, entropy threshold 0.4, position
# penalty 0.02); the engine encodes the text with tokenizer.encode and stops at the EOS.


def wedlm_run(path, spec, prompt, max_tokens=512):
    from reference import wedlm_torch

    reach = []
    eos = spec.eos_token_ids[0]
    completion, forwards = wedlm_torch.generate(
        path, prompt, max_tokens, spec.mask_token_id, stop_token_ids=(eos,), reach=reach
    )
    return Outcome(cut_at_eos(completion, {eos}), forwards, max(reach) - len(prompt))


# ------------------------------------------------------------------------------------------- CoDA
# SalesforceAIResearch/CoDA @ d7241fc serving/fast-api (app/core/service.py with config.py's
# defaults, the repository's deployment): apply_chat_template(messages, return_tensors="pt",
# return_dict=True, add_generation_prompt=True); diffusion_generate(max_new_tokens=256, steps=128,
# temperature=0.0, top_p=None, top_k=None, alg="entropy", alg_temp=0.1). alg_temp 0.1 draws the
# positions (torch.multinomial), so the tokens are held at alg_temp 0.


def coda_run(path, spec, prompt, alg_temp):
    from reference.coda_torch import coda_generate, reference_forward

    forward, seen = spans(reference_forward(path), lambda x: x.shape[1])
    seq = coda_generate(
        forward,
        [prompt],
        256,
        128,
        alg="entropy",
        alg_temp=alg_temp,
        temperature=0.0,
        mask_token_id=spec.mask_token_id,
    )
    tokens = cut_at_eos(seq[0, len(prompt) :], set(spec.eos_token_ids))
    return Outcome(tokens, len(seen), max(seen) - len(prompt))


# --------------------------------------------------------------------------------------- dllm A2D
# ZHZisZZ/dllm @ ca17675 examples/a2d/mdlm/sample.py: apply_chat_template(messages,
# add_generation_prompt=True, tokenize=True); MDLMSampler.sample with its SamplerConfig: steps=128,
# max_new_tokens=128, block_size=32, temperature=0.0, remasking="low_confidence",
# right_shift_logits=False. The sampler runs every block's steps: it has no stop on EOS.


def a2d_run(path, spec, prompt):
    from reference.dllm_a2d import mdlm_sample, reference_forward

    forward, seen = spans(reference_forward(path), lambda x, attention_mask: x.shape[1])
    eos = spec.eos_token_ids[0]
    seq = mdlm_sample(forward, [prompt], 128, 32, 128, mask_id=spec.mask_token_id, eos_id=eos)
    tokens = cut_at_eos(seq[0, len(prompt) :], set(spec.eos_token_ids))
    return Outcome(tokens, len(seen), max(seen) - len(prompt))


# ------------------------------------------------------------------------------------ Open-dCoder
# pengzhangzhi/Open-dLLM @ ea477d6 sample.py: no chat template, tokenizer(prompt).input_ids of
# "\nWrite a quick sort algorithm in Python.\n"; MDMGenerationConfig(max_new_tokens=128,
# steps=128, temperature=0.5, top_k=200, alg="p2", alg_temp=0.5) through diffusion_generate (p2
# reads no alg_temp). Temperature 0.5 samples x0, so the tokens are held at temperature 0.
SAMPLE_PY_PROMPT = "\nWrite a quick sort algorithm in Python.\n"


def open_dcoder_run(path, spec, prompt, temperature):
    from reference.open_dcoder_torch import mdm_sample, reference_logits

    seen = []

    def forward(x):
        seen.append(x.shape[1])
        return reference_logits(path, x)

    seq, nfe = mdm_sample(
        forward,
        [prompt],
        128,
        128,
        mask_token_id=spec.mask_token_id,
        alg="p2",
        alg_temp=0.5,
        temperature=temperature,
        top_k=200,
    )
    tokens = cut_at_eos(seq[0, len(prompt) :], set(spec.eos_token_ids))
    return Outcome(tokens, nfe, max(seen) - len(prompt))


# ---------------------------------------------------------------------------------------- BD3-LM
# kuleshov-group/bd3lms README.md, "Generate Arbitrary-Length Sequences" (HuggingFace model):
# main.py mode=sample_eval algo=bd3lm algo.T=5000 model.length=$LENGTH block_size=$BLOCK_SIZE
# sampling.nucleus_p=0.9 sampling.kv_cache=true (first_hitting's default: one mask a step),
# unconditional: [BOS] then LENGTH - 1 masks. LENGTH is the fixture's model length (64) here.


def bd3lm_run(path, bos, length, draws):
    """The reference's sample with the draws `draws` recorded from the package's run."""
    import json

    from safetensors.numpy import load_file

    from reference.bd3lm_torch import BD3LMReference

    cfg = json.loads((path / "config.json").read_text())
    ref = BD3LMReference(load_file(str(path / "model.safetensors")), cfg)
    seq, nfe = ref.sample([[bos]], length - 1, 0.9, draws.ref_tokens, draws.ref_position)
    return Outcome(cut_at_eos(seq[0, 1:], {bos}), nfe, seq.shape[1] - 1)


# ------------------------------------------------------------------------------- Stable-DiffCoder
# ByteDance-Seed/Stable-DiffCoder README.md: apply_chat_template(m, add_generation_prompt=True,
# tokenize=False), tokenizer(prompt)["input_ids"]; model.generate(input_ids, steps=512,
# gen_length=512, block_length=4, temperature=0., remasking="low_confidence", shift=False,
# threshold=None, eos_id=tokenizer.eos_token_id): one token a step. 512 positions are past the
# fixture's context (512 with the prompt): gen_length = steps = 128 here.


def stable_diffcoder_run(path, spec, prompt, gen_length=128):
    from reference.stable_diffcoder_torch import generate_block

    eos, stores = spec.eos_token_ids[0], []
    x, nfe = generate_block(
        path, prompt, gen_length, gen_length, 4, spec.mask_token_id, eos_id=eos, stores=stores
    )
    return Outcome(cut_at_eos(x[len(prompt) :], {eos}), nfe, len(x) - len(prompt), 0, len(stores))
