"""Independent torch reference for WeDLM (github.com/Tencent/WeDLM @ 0216110).

* `load_reference`: transformers' Qwen3ForCausalLM (the 8B layout: qk_norm, no biases) or
  Qwen2ForCausalLM (the 7B layout: q/k/v biases) on the checkpoint's own weights, under its config
  relabelled. hf_compat/modeling_wedlm.py is Qwen's decoder with those two switches, causal
  attention, RoPE on the given position ids; its weight names are Qwen's.
* `generate`: a transcription of the reference engine's decoding, with a transformers DynamicCache
  in place of its paged cache: the prefill (model_runner.prepare_prefill: the prompt, causal), then
  per step wedlm/engine/wedlm_decoder.py's `_refill_window_masks`, `_prepare_window_inputs` (the
  window reordered non-mask first, position ids the original positions, K/V written after the
  committed ones), the forward under causal attention over that order, `process_decode_outputs`
  (`_process_pruned_tokens`: the filled prefix leaves the window, stop token or max_tokens finish)
  and wedlm/engine/sampler.py's `process_mask_positions` (Categorical entropy of the raw logits,
  `sample_tokens`, `select_positions_to_fill`); the cache is cut back to the committed tokens after
  each step, as the next step's window overwrites the slots after them. The scheduler's
  `postprocess` appends the returned tokens one by one and stops at a stop token (kept) or at
  max_tokens. `torch.multinomial` is the sampler's draw (a test may patch it).

The reordering here is real (tokens permuted, positions given); the package instead keeps the
window in place under the equivalent mask, so the two are independent readings.
"""

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .hf_body import load_relabelled

torch.set_num_threads(1)


@functools.lru_cache(maxsize=4)
def load_reference(ckpt):
    def fields(cfg):
        if cfg.get("qk_norm"):
            return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
        return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"])

    drop = ("auto_map", "mask_token_id", "qk_norm", "layer_types", "use_sliding_window")
    return load_relabelled(ckpt, fields, drop)


def causal_mask(queries, keys):
    """The additive (1, 1, queries, keys) mask of causal attention for the last `queries` of
    `keys` positions. Given explicitly: without a mask, transformers reads position ids that go
    down (the reordered window's) as the start of another packed sequence and cuts attention
    there, which the reference's flash-attention call (causal=True over the slots) never does."""
    q = torch.arange(keys - queries, keys)[:, None]
    keep = torch.arange(keys)[None, :] <= q
    return torch.zeros(1, 1, queries, keys).masked_fill(~keep, torch.finfo(torch.float32).min)


def reference_logits(ckpt, input_ids, position_ids=None):
    """float32 logits (1, L, V) of causal attention over `input_ids` in the order given, with RoPE
    at `position_ids` (default 0..L-1)."""
    model = load_reference(str(ckpt))
    x = torch.as_tensor(np.asarray(input_ids)).long()
    n = x.shape[1]
    pos = torch.arange(n).expand_as(x) if position_ids is None else position_ids
    with torch.no_grad():
        out = model(
            input_ids=x,
            position_ids=torch.as_tensor(np.asarray(pos)).long(),
            attention_mask=causal_mask(n, n),
        )
    return out.logits.float().numpy()


# --- wedlm/engine/sampler.py -----------------------------------------------------------------


def compute_entropy(logits):
    return torch.distributions.Categorical(logits=logits).entropy()


def _apply_top_k(logits, top_k):
    if top_k <= 0:
        return logits
    top_k = min(top_k, logits.size(-1))
    indices_to_remove = logits < torch.topk(logits, top_k, dim=-1).values[..., -1, None]
    return logits.masked_fill(indices_to_remove, float("-inf"))


def _apply_top_p(logits, top_p):
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_indices = torch.sort(logits, descending=True, dim=-1)
    cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative_probs > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    indices_to_remove = remove.scatter(dim=-1, index=sorted_indices, src=remove)
    return logits.masked_fill(indices_to_remove, float("-inf"))


def sample_tokens(logits, temperature, top_p=1.0, top_k=0):
    probs = F.softmax(logits, dim=-1)
    greedy_ids = probs.argmax(dim=-1)
    if temperature == 0:
        return greedy_ids
    filtered = _apply_top_p(_apply_top_k(logits, top_k), top_p)
    sampling_probs = F.softmax(filtered / temperature, dim=-1)
    return torch.multinomial(sampling_probs, num_samples=1).squeeze(-1)


def select_positions_to_fill(entropy, remaining_mask_indices, entropy_threshold, pos_penalty):
    mask_indices_tensor = torch.tensor(remaining_mask_indices, dtype=torch.float)
    distances = mask_indices_tensor - mask_indices_tensor[0]
    adjusted_entropy = entropy + distances * pos_penalty
    if entropy_threshold is not None:
        candidates = (adjusted_entropy < entropy_threshold).nonzero(as_tuple=True)[0]
        if candidates.numel() > 0:
            return candidates.tolist()
    return [int(adjusted_entropy.argmin().item())]


def process_mask_positions(mask_logits, remaining, temperature, threshold, penalty, top_p, top_k):
    entropy = compute_entropy(mask_logits)
    sampled_ids = sample_tokens(mask_logits, temperature, top_p, top_k)
    fill_indices = select_positions_to_fill(entropy, remaining, threshold, penalty)
    return fill_indices, [int(sampled_ids[k].item()) for k in fill_indices]


# --- wedlm/engine/wedlm_decoder.py, model_runner.py, scheduler.py -------------------------------


def _forward(model, cache, ids, positions, start):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            cache=cache,
            cache_position=torch.arange(start, start + len(ids)),
            attention_mask=causal_mask(len(ids), start + len(ids)),
            use_cache=True,
        )
    return out.logits[0].float()


def _prune(state, prune_count, stop_token_ids, num_prompt, max_tokens):
    """`_process_pruned_tokens`: the committed prefix leaves the window."""
    if prune_count == 0:
        return []
    pruned = state["tokens"][:prune_count]
    for t in pruned:
        state["len"] += 1
        if t in stop_token_ids or state["len"] - num_prompt >= max_tokens:
            state["finished"] = True
            break
    if state["finished"]:
        stop = next((i + 1 for i, t in enumerate(pruned) if t in stop_token_ids), len(pruned))
        state["tokens"], state["flags"] = [], []
        return pruned[:stop]
    state["tokens"] = state["tokens"][prune_count:]
    state["flags"] = state["flags"][prune_count:]
    return pruned


def generate(
    ckpt,
    prompt,
    max_tokens,
    mask_token_id,
    window_size=16,
    entropy_threshold=0.4,
    pos_penalty_factor=0.02,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    stop_token_ids=(),
    reach=None,
):
    """The completion token ids of one prompt, and the number of decode forwards. `reach`, a
    list, receives each decode forward's end: the position after the last one it covers."""
    from transformers import DynamicCache

    model = load_reference(str(ckpt))
    cache = DynamicCache(config=model.config)
    _forward(model, cache, list(prompt), list(range(len(prompt))), 0)  # prefill
    state = dict(
        tokens=[mask_token_id] * window_size,
        flags=[True] * window_size,
        len=len(prompt),
        finished=False,
    )
    completion, forwards = [], 0
    while True:
        # _refill_window_masks
        mask_idx = [i for i, f in enumerate(state["flags"]) if f]
        prefix_len = mask_idx[0] if mask_idx else len(state["tokens"])
        state["tokens"] += [mask_token_id] * prefix_len
        state["flags"] += [True] * prefix_len
        # _prepare_window_inputs
        non_mask = [i for i, f in enumerate(state["flags"]) if not f]
        masks = [i for i, f in enumerate(state["flags"]) if f]
        order = non_mask + masks
        ids = [state["tokens"][i] for i in order]
        positions = [state["len"] + i for i in order]
        start = state["len"]
        logits = _forward(model, cache, ids, positions, start)
        forwards += 1
        if reach is not None:
            reach.append(start + len(ids))
        # process_decode_outputs
        mask_idx = [i for i, f in enumerate(state["flags"]) if f]
        prune_count = mask_idx[0] if mask_idx else len(state["tokens"])
        pruned = _prune(state, prune_count, set(stop_token_ids), len(prompt), max_tokens)
        # The committed tokens' K/V sit first among the window's (they lead the reordering); the
        # slots after them are rewritten by the next step.
        drop = cache.get_seq_length() - state["len"]
        if drop:
            cache.crop(-drop)
        remaining = [i for i, f in enumerate(state["flags"]) if f]
        if remaining and not state["finished"]:
            mask_logits = logits[len(non_mask) :]
            fill, token_ids = process_mask_positions(
                mask_logits,
                remaining,
                temperature,
                entropy_threshold,
                pos_penalty_factor,
                top_p,
                top_k,
            )
            for k, token_id in zip(fill, token_ids):
                state["tokens"][remaining[k]] = token_id
                state["flags"][remaining[k]] = False
        # scheduler.postprocess
        for t in pruned:
            completion.append(t)
            if t in stop_token_ids or len(completion) >= max_tokens:
                return completion, forwards
        if state["finished"]:
            return completion, forwards
