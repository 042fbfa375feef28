"""Structured output (issue #31): tokens per forward and tokens per second, constrained against
unconstrained on the same prompts, and how often the answer is valid and right.

    python benchmarks/bench_structured.py [--problems 200] [--mask-cost | --only-mask-cost]
        [--markdown]

Part 1, the embedded default model (trained on bare answers to sums of two-digit numbers): the
held-out problems one prompt at a time through the chat template, as `mlx_dllm generate` runs
them, greedy, under the default quota sampler and a confidence threshold (the sampler that
commits several tokens a step), with no constraint, a regex that allows the bare answer
(`[0-9]{1,4}`), and the issue's JSON schema ({"answer": integer}) at the default budget (16 tokens)
and at 32. Columns: valid (the text matches the regex / parses as JSON and validates), right (the
number is the sum), tokens per forward (answer tokens, EOS excluded, over the problem's model
forwards), forwards per problem, tokens per second (wall clock: compare rows of one run only).

Part 2 (--mask-cost): what the constraint costs the host per committed token at a real vocabulary
size: a byte-level BPE tokenizer trained here to 128k tokens on local Python sources, a JSON schema,
and llguidance's calls of one committed token (the allowed-token mask, consuming the token, the
budget guard's closing search) timed along a JSON answer.
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}
REGEX = "[0-9]{1,4}"


def answer_of(text, kind):
    """(valid, the answer as an int or None)."""
    if kind == "json_schema":
        import jsonschema

        try:
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False, None
        return True, value.get("answer")
    if kind == "regex" and not re.fullmatch(REGEX, text):
        return False, None
    try:
        return True, int(text.strip())
    except ValueError:
        return kind != "regex", None


def run(model, tokenizer, problems, settings, kind):
    from mlx_dllm_models import stream_generate_diffusion
    from mlx_dllm_models.default import chat_prompt

    valid = right = nfe = tokens = 0
    tic = time.perf_counter()
    for message, answer in problems:
        text, last = "", None
        for last in stream_generate_diffusion(
            model, tokenizer, chat_prompt(tokenizer, message), **settings
        ):
            text += last.text
        ok, value = answer_of(text, kind)
        valid += ok
        right += value == int(answer)
        nfe += last.nfe
        tokens += last.generation_tokens
    wall = time.perf_counter() - tic
    n = len(problems)
    return dict(
        valid=valid / n,
        right=right / n,
        tpf=tokens / max(nfe, 1),
        fwd=nfe / n,
        tps=tokens / wall,
    )


def part_one(problems, markdown):
    from mlx_dllm_models import load
    from mlx_dllm_models.default import default_checkpoint

    model, tokenizer = load(default_checkpoint())
    samplers = [
        ("quota (default)", {}),
        ("threshold 0.5", dict(sampler="threshold", threshold=0.5)),
    ]
    constraints = [
        ("none", "plain", {}),
        (f"regex {REGEX}", "regex", dict(regex=REGEX)),
        ('json_schema {"answer": integer}', "json_schema", dict(json_schema=SCHEMA)),
        (
            'json_schema {"answer": integer}, max_tokens 32',
            "json_schema",
            dict(json_schema=SCHEMA, max_tokens=32),
        ),
    ]
    rows = []
    for sampler, s in samplers:
        for name, kind, c in constraints:
            r = run(model, tokenizer, problems, dict(s, temperature=0, **c), kind)
            rows.append((sampler, name, r))
            line = (
                f"| {sampler} | {name} | {r['valid']:.1%} | {r['right']:.1%} | {r['tpf']:.2f} | "
                f"{r['fwd']:.1f} | {r['tps']:.0f} |"
            )
            print(line if markdown else line.replace("|", " "), flush=True)
    return rows


def big_tokenizer(vocab=128_000):
    """A byte-level BPE tokenizer trained to `vocab` tokens on the Python sources installed here
    (a stand-in for a real checkpoint's 100k-150k vocabulary: the mask cost depends on its size
    and on how many tokens a grammar state allows)."""
    import site

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = []
    for root in site.getsitepackages():
        files += [str(p) for p in Path(root).glob("*/**/*.py")][:4000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def part_two(markdown):
    import numpy as np
    from llguidance import LLMatcher

    from mlx_dllm_models.decoding.constrained import completion
    from mlx_dllm_models.structured import compile_rows

    tic = time.perf_counter()
    hf = big_tokenizer()
    vocab = len(hf)
    eos = [hf.convert_tokens_to_ids("<|endoftext|>")]
    print(f"tokenizer: {vocab} tokens, trained in {time.perf_counter() - tic:.0f} s")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "tags"],
    }
    tic = time.perf_counter()
    (c,) = compile_rows(dict(json_schema=schema), 1, hf, vocab, eos)
    print(f"llguidance tokenizer and grammar: {time.perf_counter() - tic:.2f} s")
    text = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "notes"]})
    tokens = hf.encode(text, add_special_tokens=False)
    m: LLMatcher = c.matcher()
    times = {"mask": [], "consume": [], "guard": [], "forced": []}
    for t in tokens:
        t0 = time.perf_counter()
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        t1 = time.perf_counter()
        ok = m.try_consume_tokens([t]) == 1
        t2 = time.perf_counter()
        completion(m, 64, c.candidates)
        t3 = time.perf_counter()
        m.compute_ff_tokens()
        t4 = time.perf_counter()
        assert ok and words.size * 32 >= vocab
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k].append(v)
    print(f"{len(tokens)} tokens of {text}")
    for k, v in times.items():
        line = f"| {k} | {np.median(v) * 1e6:.0f} us | {np.max(v) * 1e6:.0f} us |"
        print(line if markdown else line.replace("|", " "))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--problems", type=int, default=200)
    p.add_argument("--mask-cost", action="store_true")
    p.add_argument("--only-mask-cost", action="store_true", help="part 2 alone")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    from mlx_dllm_models.default import held_out_problems

    if not args.only_mask_cost:
        if args.markdown:
            print("| sampler | constraint | valid | right | tokens/forward | forwards | tok/s |")
            print("|---|---|---|---|---|---|---|")
        part_one(held_out_problems(args.problems), args.markdown)
    if args.mask_cost or args.only_mask_cost:
        if args.markdown:
            print("\n| host call per token | median | max |\n|---|---|---|")
        part_two(args.markdown)


if __name__ == "__main__":
    main()
