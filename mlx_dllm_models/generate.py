"""Public API: generate_diffusion, stream_generate_diffusion, batch_generate_diffusion (and load,
from loader.py).

Mirrors mlx-lm's generate / stream_generate: a prompt is text (tokenized as mlx-lm does, no chat
template) or a list of token ids; generation stops at an EOS, which is not returned
(finish_reason "stop"), else at max_tokens (finish_reason "length").
"""

import time
from dataclasses import dataclass, replace
from typing import Iterator, List, Optional, Sequence

import mlx.core as mx

from .engine import BlockEvent, TokenLogprob
from .request import Detokenizer, Prompt, prepare
from .settings import SettingsError


@dataclass
class DiffusionResponse:
    """One committed block of one prompt, with running statistics.

    Attributes:
        text: the new text since the previous response.
        tokens: the new token ids since the previous response.
        finish_reason: None while generating, then "stop" (an EOS, not returned) or "length".
        prompt_tokens: the prompt's length in tokens.
        generation_tokens: tokens generated so far.
        nfe: model forwards so far (number of function evaluations).
        tokens_per_forward: generation_tokens / nfe.
        prompt_tps: prompt tokens a second of the prefill.
        generation_tps: generated tokens a second so far.
        peak_memory: MLX's peak memory so far, in GB.
        logprobs: with the `logprobs` setting, one TokenLogprob per token of `tokens`.
    """

    text: str  # new text since the previous response
    tokens: List[int]  # new token ids since the previous response
    finish_reason: Optional[str]  # None while generating, then "stop" (EOS) or "length"
    prompt_tokens: int
    generation_tokens: int  # tokens generated so far
    nfe: int  # model forwards so far
    tokens_per_forward: float
    prompt_tps: float
    generation_tps: float
    peak_memory: float  # GB
    # With the logprobs setting: one TokenLogprob per token of `tokens` (its log-probability at
    # the step that committed it, and that step's best alternatives); else None.
    logprobs: Optional[List[TokenLogprob]] = None


@dataclass
class BatchResponse:
    """The results of batch_generate_diffusion, in the prompts' order.

    Attributes:
        texts: each prompt's text.
        tokens: each prompt's token ids.
        finish_reasons: each prompt's "stop" or "length".
        nfe: model forwards of the whole batch.
        tokens_per_forward: generated tokens over forwards, all rows together.
        generation_tps: generated tokens a second, all rows together.
        peak_memory: MLX's peak memory, in GB.
        logprobs: with the `logprobs` setting, per prompt one TokenLogprob per token.
    """

    texts: List[str]
    tokens: List[List[int]]
    finish_reasons: List[str]
    nfe: int
    tokens_per_forward: float
    generation_tps: float
    peak_memory: float
    logprobs: Optional[List[List[TokenLogprob]]] = None  # per prompt, with the logprobs setting


# ------------------------------------------------------------------------------------- generate


def stream_events(
    model, tokenizer, prompts: Sequence[Prompt], images=None, suffix=None, **settings
):
    """Low-level stream of engine events (StepEvent, BlockEvent) for a batch; used by the CLI's
    live view. `images`: None, or one entry per prompt: None (no image), an image (a path, PIL
    image or array) or a list of them, for text prompts, with the processor that `load` returns
    for a multimodal checkpoint. Returns (settings, prompt_ids, decoder);
    `decoder.run(prompt_ids)` yields the events. `suffix` (text or ids, infilling): every prompt
    is followed by max_tokens masks and then the suffix, and the masks are filled."""
    request = prepare(model, tokenizer, prompts, settings, images=images, suffix=suffix)
    return request.settings, request.ids, request.decoder(model)


def stream_generate_diffusion(
    model, tokenizer, prompt: Prompt, image=None, suffix=None, trace=None, **settings
) -> Iterator[DiffusionResponse]:
    """Yield a DiffusionResponse each time a block (a canvas) is committed, as it happens.

    Args:
        model: a model from `load`.
        tokenizer: the tokenizer (or, for a vision checkpoint, the processor) from `load`.
        prompt: text (tokenized as mlx-lm does: no chat template) or a list of token ids.
        image: a path, PIL image or array, or a list of them, with the processor of a vision
            checkpoint; a prompt without image placeholders gets the images first.
        suffix: text or ids for infilling (families whose attention sees a suffix): `max_tokens`
            masks go between the prompt and the suffix and are filled; mask tokens inside the
            prompt are filled too. The responses carry the filled span, never the suffix.
        trace: a path ("out.html"): once generation ends, a page replaying the decoding step by
            step is written there, and the final order of commitment as an SVG beside it.
        **settings: the decoding settings (`max_tokens`, `sampler`, `steps`, `block_length`,
            `temperature`, `seed`, ..., and the family's own; the settings reference lists them).
            Unset ones come from the checkpoint, then the family's reference defaults.

    Yields:
        DiffusionResponse: one per committed block, the last with its `finish_reason`.

    Raises:
        SettingsError: an unknown setting, one the family or sampler does not use, a value out of
            range, or a malformed prompt; the message says what to do.
    """
    images = None if image is None else [image]
    s, ids, decoder = stream_events(
        model, tokenizer, [prompt], images=images, suffix=suffix, **settings
    )
    recorder = None
    if trace is not None:
        from .trace import TraceRecorder

        recorder = TraceRecorder(model, tokenizer, ids[0], s, decoder, trace)
    yield from responses(decoder, ids, tokenizer, trace=recorder)


def responses(
    decoder, ids, tokenizer, on_step=None, prior=None, trace=None
) -> Iterator[DiffusionResponse]:
    """DiffusionResponses of a one-prompt decoder run; `on_step(StepEvent)` sees every denoising
    step (the CLI's live view draws from it); `prior` (a cache.PriorKV from the decoder's
    `kv_prefix` after an earlier run) lets the prefill reuse that run's K/V (chat.py); `trace`
    (a trace.TraceRecorder) records every event, and writes its page when the run ends."""
    detok = Detokenizer(tokenizer)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_time = None
    generated = 0
    events = decoder.run(ids) if prior is None else decoder.run(ids, prior=prior)
    for event in events:
        if prompt_time is None and decoder.nfe > 0:
            prompt_time = time.perf_counter() - tic
        if trace is not None:
            trace.event(event)
        if not isinstance(event, BlockEvent):
            if on_step is not None:
                on_step(event)
            continue
        toks = event.tokens[0]
        generated += len(toks)
        done = event.finished[0]
        text = detok.add(toks)
        if done:
            text += detok.flush()
        elapsed = time.perf_counter() - tic
        reason = None
        if done:
            reason = "stop" if event.eos[0] else "length"
        if done and trace is not None:  # before the last response: its reader may stop there
            trace.write()
        yield DiffusionResponse(
            text=text,
            tokens=toks,
            finish_reason=reason,
            prompt_tokens=len(ids[0]),
            generation_tokens=generated,
            nfe=decoder.nfe,
            tokens_per_forward=generated / max(decoder.nfe, 1),
            prompt_tps=len(ids[0]) / prompt_time if prompt_time else 0.0,
            generation_tps=generated / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            logprobs=None if event.logprobs is None else event.logprobs[0],
        )
        if done:
            return


def generate_diffusion(
    model,
    tokenizer,
    prompt: Prompt,
    *,
    max_tokens: Optional[int] = None,
    verbose: bool = False,
    image=None,
    trace=None,
    **settings,
) -> str:
    """Generate a completion of `prompt` and return its text.

    Args:
        model: a model from `load`.
        tokenizer: the tokenizer (or processor) from `load`.
        prompt: text (no chat template applied) or a list of token ids.
        max_tokens: new tokens at most (an EOS may end earlier; it is not returned).
        verbose: print the text as blocks are committed, then a statistics line.
        image: images for a vision checkpoint (see stream_generate_diffusion).
        trace: a path for the replay page of the decoding (see stream_generate_diffusion).
        **settings: the decoding settings, as stream_generate_diffusion takes them.

    Returns:
        The generated text.

    Raises:
        SettingsError: a bad setting or prompt, with what to do.
    """
    text = ""
    last = None
    for last in stream_generate_diffusion(
        model, tokenizer, prompt, image=image, max_tokens=max_tokens, trace=trace, **settings
    ):
        if verbose:
            print(last.text, end="", flush=True)
        text += last.text
    if verbose and last is not None:
        print()
        print("=" * 10)
        print(stats_line(last))
    return text


def stats_line(r: DiffusionResponse) -> str:
    """mlx-lm's closing statistics line, with the diffusion statistics."""
    return (
        f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tokens-per-sec | "
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tokens-per-sec | "
        f"NFE: {r.nfe}, {r.tokens_per_forward:.2f} tokens/forward | "
        f"Peak memory: {r.peak_memory:.3f} GB"
    )


# batch_generate_diffusion runs rows of similar length together: a row joins a run while its
# length (prompt + generation) is at most this much above the run's shortest, as a fraction or in
# positions, whichever is more. Each forward is padded to the run's longest row, and a padded
# position costs what a real one does; the rows of a run share each forward's fixed cost.
RUN_SLACK = 1 / 8
RUN_SLACK_POSITIONS = 16


def length_runs(lengths: Sequence[int]) -> List[List[int]]:
    """Row indices grouped into runs of similar length (RUN_SLACK), shortest first, each run in
    the caller's order: within a run no row is padded by more than the slack."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    runs: List[List[int]] = []
    for i in order:
        if runs:
            shortest = lengths[runs[-1][0]]
            if lengths[i] - shortest <= max(shortest * RUN_SLACK, RUN_SLACK_POSITIONS):
                runs[-1].append(i)
                continue
        runs.append([i])
    return [sorted(run) for run in runs]


def batch_generate_diffusion(
    model, tokenizer, prompts: Sequence[Prompt], images=None, **settings
) -> BatchResponse:
    """Generate for several prompts at once; the results come in the prompts' order.

    Rows of similar length (prompt + generation, within RUN_SLACK) decode together, left-padded,
    each row dropped from its run at its own EOS; runs of different lengths decode one after
    another, so that no row is padded far beyond its own length. At temperature 0 each row gets
    the tokens it would get alone. Above it, the masked decoder's rows draw from streams of their
    own (each the `seed` setting's), so they still do; with the decoders that draw batch-wide
    (WeDLM, self-speculation) a row's draws depend on the rows it decodes with; the same call
    (prompts, settings, `seed`) returns the same tokens.

    Args:
        model: a model from `load`.
        tokenizer: the tokenizer (or processor) from `load`.
        prompts: a list of prompts, each text or a list of token ids.
        images: None, or one entry per prompt (None, an image, or a list of images): each row
            reads its own images.
        **settings: the decoding settings, as stream_generate_diffusion takes them (`suffix`
            included), shared by every row.

    Returns:
        BatchResponse: texts, tokens and finish reasons per prompt, and the batch's statistics.

    Raises:
        SettingsError: `prompts` is not a non-empty list, or a bad setting or prompt.
    """
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, (list, tuple)):
        raise SettingsError(
            f"prompts must be a list of prompts (each text or a list of token ids), got "
            f"{type(prompts).__name__}; for one prompt pass [prompt] or use generate_diffusion"
        )
    if not prompts:
        raise SettingsError("prompts is empty: give at least one prompt")
    suffix = settings.pop("suffix", None)
    request = prepare(model, tokenizer, prompts, settings, images=images, suffix=suffix)
    s, ids = request.settings, request.ids
    out = [[] for _ in ids]
    logprobs = None if s.logprobs is None else [[] for _ in ids]
    reasons = ["length"] * len(ids)
    nfe = 0
    mx.reset_peak_memory()
    tic = time.perf_counter()
    generated = s.max_tokens + len(request.suffix)
    for run in length_runs([len(row) + generated for row in ids]):
        pixels = request.pixel_values
        part = replace(
            request,
            ids=[ids[i] for i in run],
            pixel_values=None if pixels is None else [pixels[i] for i in run],
        )
        decoder = part.decoder(model)
        for event in decoder.run(part.ids):
            if isinstance(event, BlockEvent):
                for i, (row, toks, hit) in enumerate(zip(event.rows, event.tokens, event.eos)):
                    row = run[row]
                    out[row].extend(toks)
                    if logprobs is not None:
                        logprobs[row].extend(event.logprobs[i])
                    if hit:
                        reasons[row] = "stop"
        nfe += decoder.nfe
    elapsed = time.perf_counter() - tic
    total = sum(len(t) for t in out)
    return BatchResponse(
        texts=[tokenizer.decode(t) for t in out],
        tokens=out,
        finish_reasons=reasons,
        nfe=nfe,
        tokens_per_forward=total / max(nfe, 1),
        generation_tps=total / elapsed if elapsed > 0 else 0.0,
        peak_memory=mx.get_peak_memory() / 1e9,
        logprobs=logprobs,
    )
