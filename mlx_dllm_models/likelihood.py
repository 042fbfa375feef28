"""Likelihood of a continuation under a masked diffusion model, as the references evaluate it.

`log_likelihood(model, tokenizer, prompt, continuation)`: a Monte-Carlo estimate of the ELBO, a
lower bound of log p(continuation | prompt), over mc_samples noised copies of prompt + continuation
(batch_size rows per forward); the prompt is never masked.

* LLaDA, LLaDA-MoE: ML-GSAI/LLaDA `get_log_likelihood.py`. Per batch, k ~ U{1..L} (L the
  continuation's length) and the rows' mask counts x_b = round(linspace(k, k + (B-1) L/B, B)),
  wrapped into 1..L, so that one batch spreads its counts over the whole range; row b masks x_b
  continuation positions chosen uniformly, and its term is sum(CE at the masked positions) / (x_b/L).
  Estimate: -(mean over batches of sum(terms) / B). `cfg_scale` as generate.py's (the prompt masked
  in the unconditional row).
* Dream: DreamLM/Dream `eval/eval.py`, `_eval_target_nll_mc` with log_type "ftb": the continuation
  is followed by EOS (its `_encode_pair` appends it) and that last position is never masked; row b
  has the noise level t_b = (u0 + b/B) mod 1 (training.sample_noise's low-discrepancy levels: the
  same set of levels), mask probability p_b = (1 - eps) t_b + eps with eps 1e-3, each continuation
  position masked independently with p_b; term CE / p_b; logits shifted (position i scores from
  hidden state i-1). Dream's eval has no guidance in this path: cfg_scale is refused.
* Other families (block-causal SDAR / LLaDA2, Nemotron, DiffusionGemma): no reference estimator of
  this kind to reproduce; a clear error.

`greedy_matches(...)`: LLaDA `eval_llada.py`'s `suffix_greedy_prediction`: the continuation's
positions start as masks and are decoded one per step, the most confident first, at temperature 0;
True when that gives exactly the continuation. It runs on the engine (quota sampler, one block,
steps = length), which is that procedure; Dream's eval has no such check, and the same rule runs
with its logit shift.

The forward process and the logit alignment are training.py's (`mask_tokens`, `forward_process`,
`align_logits`, `weighted_nll`): the loss and the estimators share them.
"""

from typing import List, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from .decoding.llada import guided_logits, unconditional_tokens
from .engine import BlockEvent, make_decoder
from .masks import every_key
from .request import encode, prepare
from .settings import SettingsError
from .spec import BIDIRECTIONAL, TIMESTEP_ELBO
from .training import align_logits, forward_process, mask_tokens, sample_noise, weighted_nll
from .vision import text_tokenizer

Text = Union[str, Sequence[int]]

DREAM_SAMPLING_EPS = 1e-3  # eval.py's sampling_eps, the floor of the mask probability


def _check_family(model, what: str):
    spec = getattr(model, "diffusion_spec", None)
    if spec is None:
        raise TypeError(f"{type(model).__name__} is not a diffusion model of this package")
    if spec.likelihood is None or spec.attention != BIDIRECTIONAL:
        raise SettingsError(
            f"{what} follows LLaDA's and Dream's references (a bidirectional masked-diffusion "
            f"ELBO); the {spec.family} family ({spec.attention} attention) has no such estimator "
            "here. Use LLaDA, LLaDA-MoE or Dream"
        )
    return spec


def _pair(tokenizer, prompt: Text, continuation: Text) -> Tuple[List[int], List[int]]:
    ids = encode(tokenizer, prompt)
    if isinstance(continuation, str):
        cont = text_tokenizer(tokenizer).encode(continuation, add_special_tokens=False)
    else:
        cont = [int(t) for t in continuation]
    if not cont:
        raise SettingsError("the continuation is empty: give at least one token to score")
    return ids, list(cont)


def draw_keys(seed: int, n: int) -> List[mx.array]:
    """One PRNG key per Monte-Carlo batch."""
    return list(mx.random.split(mx.random.key(seed), n))


def llada_mask_counts(k: int, batch_size: int, length: int) -> np.ndarray:
    """get_log_likelihood.py's per-row mask counts: round(linspace(k, k + (B-1) L/B, B)) wrapped
    into 1..L (round half to even, as torch.round)."""
    x = np.round(np.linspace(float(k), k + (batch_size - 1) * (length / batch_size), batch_size))
    return ((x.astype(np.int64) - 1) % length) + 1


def llada_draws(key: mx.array, batch_size: int, length: int) -> Tuple[int, np.ndarray]:
    """(k, ranks): k ~ U{1..L}, and per row a uniform random permutation of the L continuation
    positions (rank of each); a row with count x masks the positions ranked below x, a uniform
    choice of x positions, as upstream's `randperm`."""
    k_k, k_perm = mx.random.split(key)
    k = int(mx.random.randint(1, length + 1, (), key=k_k).item())
    u = mx.random.uniform(shape=(batch_size, length), key=k_perm)
    ranks = np.array(mx.argsort(mx.argsort(u, axis=-1), axis=-1))
    return k, ranks


# The most Monte-Carlo samples an estimate takes. Each sample is one row of a forward over the
# prompt and the continuation, so the work grows with it without bound (10**9 would run for days
# without a word); the estimate's noise falls only as 1/sqrt(samples): at 2**16 it is 1/22 of that
# at LLaDA's default 128.
MAX_MC_SAMPLES = 2**16


def check_counts(mc_samples, batch_size, cfg_scale):
    """log_likelihood's mc_samples, batch_size and cfg_scale, checked (a SettingsError)."""
    for name, v in (("mc_samples", mc_samples), ("batch_size", batch_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SettingsError(f"{name} must be a positive integer, got {v!r}")
    if mc_samples > MAX_MC_SAMPLES:
        raise SettingsError(
            f"mc_samples ({mc_samples}) is above the cap of {MAX_MC_SAMPLES} (2**16): each sample "
            "is a row of a forward over the prompt and continuation, so the work has no bound, "
            "while the estimate's noise falls only as 1/sqrt(mc_samples) (LLaDA's default is 128)"
        )
    if mc_samples % batch_size:
        raise SettingsError(
            f"mc_samples ({mc_samples}) must be a multiple of batch_size ({batch_size}): the "
            "estimate averages mc_samples // batch_size batches, as get_log_likelihood.py does"
        )
    ok = isinstance(cfg_scale, (int, float)) and not isinstance(cfg_scale, bool)
    if not ok or not np.isfinite(cfg_scale) or cfg_scale < 0:
        raise SettingsError(f"cfg_scale must be a finite number >= 0, got {cfg_scale!r}")


def _span_logits(model, noisy, start, stop, shift, cfg_scale, prompt_len, mask_id):
    """Logits scoring positions start..stop-1 (the head over those rows only), aligned as the
    decoder reads them; with guidance, the unconditional rows (prompt masked) in the same
    forward."""
    span = (start - shift, stop)
    every = every_key(noisy.shape[1])  # the estimator's bidirectional reading, given explicitly
    if cfg_scale:
        given = mx.arange(noisy.shape[1])[None] < prompt_len
        un = unconditional_tokens(noisy, mx.broadcast_to(given, noisy.shape), mask_id)
        both = model(mx.concatenate([noisy, un]), mask=every, head_span=span)
        n = noisy.shape[0]
        logits = guided_logits(both[:n], both[n:], cfg_scale)
    else:
        logits = model(noisy, mask=every, head_span=span)
    return align_logits(logits, shift)[:, shift:]


def log_likelihood(
    model,
    tokenizer,
    prompt: Text,
    continuation: Text,
    *,
    mc_samples: int = 128,
    batch_size: int = 16,
    cfg_scale: float = 0.0,
    seed: int = 0,
) -> float:
    """Monte-Carlo ELBO estimate of log p(continuation | prompt) (nats), as LLaDA's
    get_log_likelihood.py (LLaDA, LLaDA-MoE) or Dream's eval.py "mc"/"ftb" (Dream) computes it; see
    the module docstring. Text continuations are tokenized without special tokens. mc_samples is
    at most MAX_MC_SAMPLES (2**16); Ctrl-C (KeyboardInterrupt) stops the estimate between
    batches."""
    spec = _check_family(model, "log_likelihood")
    check_counts(mc_samples, batch_size, cfg_scale)
    ids, cont = _pair(tokenizer, prompt, continuation)
    mask_id = spec.mask_token_id
    if spec.likelihood == TIMESTEP_ELBO:
        if cfg_scale:
            raise SettingsError(
                "cfg_scale is LLaDA's (get_log_likelihood.py); Dream's likelihood has none"
            )
        if not spec.eos_token_ids:
            raise SettingsError("Dream's likelihood appends EOS, but config.json has none")
        cont = cont + [spec.eos_token_ids[0]]
    P, L = len(ids), len(cont)
    seq = mx.array([ids + cont] * batch_size, dtype=mx.int32)
    answer = seq[:, P:]
    prompt_lengths = mx.full((batch_size,), P, dtype=mx.int32)
    losses = []
    for key in draw_keys(seed, mc_samples // batch_size):
        if spec.likelihood == TIMESTEP_ELBO:
            t, u = sample_noise(key, (batch_size, P + L), low_discrepancy=True)
            # The appended EOS is never masked: u = 1 is never below p < 1.
            u = mx.concatenate([u[:, :-1], mx.ones((batch_size, 1))], axis=1)
            noisy, masked, p = forward_process(
                seq, t, u, mask_id, prompt_lengths=prompt_lengths, eps=DREAM_SAMPLING_EPS
            )
        else:
            k, ranks = llada_draws(key, batch_size, L)
            counts = llada_mask_counts(k, batch_size, L)
            chosen = np.zeros((batch_size, P + L), dtype=bool)
            chosen[:, P:] = ranks < counts[:, None]
            noisy, masked = mask_tokens(seq, mx.array(chosen), mask_id, prompt_lengths)
            p = mx.array(counts / L, dtype=mx.float32)
        logits = _span_logits(model, noisy, P, P + L, spec.logit_shift, cfg_scale, P, mask_id)
        nll = weighted_nll(logits, answer, masked[:, P:], p)
        losses.append(nll.sum().item() / batch_size)
    return -float(np.mean(losses))


def greedy_matches(
    model, tokenizer, prompt: Text, continuation: Text, *, cfg_scale: float = 0.0
) -> bool:
    """LLaDA eval_llada.py's suffix greedy check: decoding len(continuation) masks after the prompt
    one token per step, the most confident first, at temperature 0, gives the continuation."""
    spec = _check_family(model, "greedy_matches")
    ids, cont = _pair(tokenizer, prompt, continuation)
    n = len(cont)
    overrides = dict(max_tokens=n, block_length=n, steps=n, sampler="quota", temperature=0.0)
    if cfg_scale:
        overrides["cfg_scale"] = cfg_scale
    if spec.confidence == "sampled":
        overrides["top_p"] = 1.0  # the model's own softmax, unfiltered
    request = prepare(model, tokenizer, [ids], overrides)
    # No EOS handling: the whole span is compared, EOS included where the continuation has it.
    decoder = make_decoder(model, request.settings, ())
    got = []
    for event in decoder.run(request.ids):
        if isinstance(event, BlockEvent):
            got.extend(event.tokens[0])
    return got == cont
