"""Plain transcriptions of Fast-dLLM's approximate-cache generators (tests only), over transformers'
models of the same weights (reference.llada_torch, reference.dream_torch).

* `generate_with_prefix_cache`, `generate_with_dual_cache`: NVlabs/Fast-dLLM `llada/generate.py`
  (low_confidence remasking; quota, or `threshold` through `get_transfer_index`).
* `dream_block_sample`: NVlabs/Fast-dLLM `dream/model/generation_utils_block.py` `_sample`, its
  `confidence_threshold` algorithm, with and without `dual_cache`.

Fast-dLLM's modeling files take `past_key_values` (per layer a (K, V) pair) and, for the dual
cache, `replace_position`. `FastDLLMModel` gives a transformers model that calling convention:
transformers' attention layers hand each layer's new K/V to `cache.update`, where `_Past` does what
Fast-dLLM's layers do with them (keep them, append them to the prefix, or write them over the
block's columns and attend to the whole cache). Positions are passed explicitly: the prefix
forward's queries sit after the prefix, the dual forward's on the block's columns.
"""

from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from .dream_torch import load_reference as load_dream
from .llada_torch import add_gumbel_noise, get_num_transfer_tokens
from .llada_torch import load_model as load_llada


class _Past:
    """transformers' cache protocol (`update`) with Fast-dLLM's past_key_values semantics."""

    def __init__(self, past=None, replace=None):
        self.past = past  # None (full forward) or per layer [K, V]
        self.replace = replace  # (start, end) of the dual cache's block columns
        self.present = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.past is None:
            kv = [key_states, value_states]
        elif self.replace is None:
            pk, pv = self.past[layer_idx]
            kv = [torch.cat([pk, key_states], dim=2), torch.cat([pv, value_states], dim=2)]
        else:
            s, e = self.replace
            kv = self.past[layer_idx]
            kv[0][:, :, s:e] = key_states
            kv[1][:, :, s:e] = value_states
        self.present.append(kv)
        return kv[0], kv[1]


class FastDLLMModel:
    """`model(x, past_key_values=None, use_cache=..., replace_position=None, attention_mask=None,
    tok_idx=None)` -> (logits, past_key_values), as Fast-dLLM's modeling files are called.
    `attention_mask`: None (every key) or a boolean keep-mask (B, 1, L_query, L_key);
    `tok_idx`: None or the query positions (B, L_query)."""

    def __init__(self, hf_model, context):
        self.hf, self.context = hf_model, context

    def __call__(
        self,
        x,
        past_key_values=None,
        use_cache=True,
        replace_position=None,
        attention_mask=None,
        tok_idx=None,
    ):
        B, L = x.shape
        replace = None
        if past_key_values is None:
            first, keys = 0, L
        elif replace_position is None:
            first = past_key_values[0][0].shape[2]
            keys = first + L
        else:
            cols = replace_position[0].nonzero()[:, 0]
            first, keys = int(cols.min()), past_key_values[0][0].shape[2]
            replace = (first, int(cols.max()) + 1)
        if tok_idx is None:
            tok_idx = torch.arange(first, first + L).expand(B, L)
        if attention_mask is None:
            attention_mask = torch.ones(B, 1, L, keys, dtype=torch.bool)
        additive = torch.zeros(attention_mask.shape, dtype=torch.float32).masked_fill(
            ~attention_mask, torch.finfo(torch.float32).min
        )
        past = _Past(past_key_values, replace)
        with torch.no_grad(), self.context():
            logits = self.hf(
                input_ids=x, attention_mask=additive, position_ids=tok_idx, cache=past
            ).logits.float()
        return SimpleNamespace(logits=logits, past_key_values=past.present)


def llada_model(ckpt_path):
    return FastDLLMModel(*load_llada(ckpt_path))


def dream_model(ckpt_path):
    import contextlib

    return FastDLLMModel(load_dream(str(ckpt_path)), contextlib.nullcontext)


# --- LLaDA: llada/generate.py -----------------------------------------------------------------


def get_transfer_index(logits, temperature, mask_index, x, num_transfer_tokens, threshold=None):
    logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
    x0 = torch.argmax(logits_with_noise, dim=-1)
    p = F.softmax(logits.to(torch.float64), dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -np.inf)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer_index[j, select_index] = True
        if threshold is not None:
            for k in range(1, int(num_transfer_tokens[j])):
                if confidence[j, select_index[k]] < threshold:
                    transfer_index[j, select_index[k]] = False
    return x0, transfer_index


def _setup(prompt, steps, gen_length, block_length, mask_id):
    prompt = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    if prompt.ndim == 1:
        prompt = prompt[None]
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt.clone()
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    return prompt, x, num_blocks, steps // num_blocks


def _block_start(model, x, start, end, steps_per_block, temperature, threshold, mask_id):
    """The block [start, end)'s first step, as both cached generates take it: a forward over all
    of `x` (its K/V returned), the block's masks committed in place; (the block's per-step commit
    counts, the K/V)."""
    num_transfer_tokens = get_num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)

    output = model(x, use_cache=True)
    mask_index = x == mask_id
    mask_index[:, end:] = 0
    x0, transfer_index = get_transfer_index(
        output.logits,
        temperature,
        mask_index,
        x,
        num_transfer_tokens[:, 0] if threshold is None else None,
        threshold,
    )
    x[transfer_index] = x0[transfer_index]
    return num_transfer_tokens, output.past_key_values


def generate_with_prefix_cache(
    model, prompt, steps, gen_length, block_length, temperature=0.0, *, mask_id, threshold=None
):
    """Returns (x, nfe), x the prompt and the canvas as numpy."""
    return _cached_generate(
        model, prompt, steps, gen_length, block_length, temperature, mask_id, threshold, dual=False
    )


def generate_with_dual_cache(
    model, prompt, steps, gen_length, block_length, temperature=0.0, *, mask_id, threshold=None
):
    """Returns (x, nfe), x the prompt and the canvas as numpy."""
    return _cached_generate(
        model, prompt, steps, gen_length, block_length, temperature, mask_id, threshold, dual=True
    )


def _cached_generate(
    model, prompt, steps, gen_length, block_length, temperature, mask_id, threshold, dual
):
    """The two cached generates, which differ only in the cache a block's later steps read: the
    prefix's (the window from the block to the end), or the whole sequence's with the block's
    positions replaced in place (`dual`; the window is the block)."""
    prompt, x, num_blocks, steps_per_block = _setup(
        prompt, steps, gen_length, block_length, mask_id
    )
    nfe = 0
    for num_block in range(num_blocks):
        start = prompt.shape[1] + num_block * block_length
        end = start + block_length
        num_transfer_tokens, past_key_values = _block_start(
            model, x, start, end, steps_per_block, temperature, threshold, mask_id
        )
        nfe += 1
        if dual:
            replace_position = torch.zeros_like(x, dtype=torch.bool)
            replace_position[:, start:end] = 1
            window, extra = end, dict(replace_position=replace_position)
        else:
            # keep only the prefix cache
            past_key_values = [[k[:, :, :start], v[:, :, :start]] for k, v in past_key_values]
            window, extra = x.shape[1], {}
        i = 1
        while (x[:, start:end] == mask_id).sum() != 0:
            nfe += 1
            mask_index = x[:, start:window] == mask_id
            mask_index[:, block_length:] = 0
            logits = model(
                x[:, start:window], past_key_values=past_key_values, use_cache=True, **extra
            ).logits
            x0, transfer_index = get_transfer_index(
                logits,
                temperature,
                mask_index,
                x[:, start:window],
                num_transfer_tokens[:, i] if threshold is None else None,
                threshold,
            )
            x[:, start:window][transfer_index] = x0[transfer_index]
            i += 1
    return x.numpy(), nfe


# --- Dream: dream/model/generation_utils_block.py ---------------------------------------------


def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None):
    """generation_utils_block.sample_tokens at temperature 0 (the max-probability token)."""
    if temperature > 0 or top_p is not None or top_k is not None:
        raise NotImplementedError("transcribed for greedy decoding")
    probs = torch.softmax(logits, dim=-1)
    confidence, x0 = probs.max(dim=-1)
    return confidence, x0


def dream_block_sample(
    model,
    input_ids,
    max_new_tokens,
    steps,
    *,
    mask_token_id,
    block_length=32,
    threshold=0.9,
    dual_cache=False,
    attention_mask=None,
):
    """`_sample` with alg="confidence_threshold" at temperature 0 -> (x as numpy, forwards)."""
    input_ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    max_length = input_ids.shape[1] + max_new_tokens
    x = F.pad(input_ids, (0, max_length - input_ids.shape[1]), value=mask_token_id)
    gen_length = max_length - input_ids.shape[1]
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    nfe = 0

    if attention_mask is not None and torch.any(torch.as_tensor(attention_mask) == 0):
        attention_mask = torch.as_tensor(np.asarray(attention_mask)).long()
        attention_mask = F.pad(attention_mask, (0, max_length - attention_mask.shape[1]), value=1)
        tok_idx = attention_mask.long().cumsum(-1) - 1
        tok_idx.masked_fill_(attention_mask == 0, 1)
        attention_mask = torch.logical_and(
            attention_mask.unsqueeze(1).unsqueeze(-2).bool(),
            attention_mask.unsqueeze(1).unsqueeze(-1).bool(),
        )
    else:
        tok_idx = None
        attention_mask = None  # "full"

    for num_block in range(num_blocks):
        current_block_start = input_ids.shape[1] + num_block * block_length
        current_block_end = current_block_start + block_length

        model_output = model(x, attention_mask=attention_mask, tok_idx=tok_idx, use_cache=True)
        nfe += 1
        past_key_values = model_output.past_key_values
        logits = model_output.logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        confidence, x0 = sample_tokens(logits)
        x[:, current_block_start] = x0[:, current_block_start]

        if not dual_cache:
            past_key_values = [
                [k[:, :, :current_block_start], v[:, :, :current_block_start]]
                for k, v in past_key_values
            ]
        else:
            replace_position = torch.zeros_like(x, dtype=torch.bool)
            replace_position[:, current_block_start:current_block_end] = 1

        while True:
            if dual_cache:
                mask_index = x[:, current_block_start:current_block_end] == mask_token_id
                window = slice(current_block_start, current_block_end)
            else:
                mask_index = x[:, current_block_start:] == mask_token_id
                window = slice(current_block_start, None)
            current_attention_mask = None
            if attention_mask is not None:
                current_attention_mask = attention_mask[:, :, window, :]
            model_output = model(
                x[:, window],
                attention_mask=current_attention_mask,
                tok_idx=tok_idx[:, window] if tok_idx is not None else None,
                past_key_values=past_key_values,
                use_cache=True,
                replace_position=replace_position if dual_cache else None,
            )
            nfe += 1
            logits = model_output.logits
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            mask_logits = logits[mask_index]
            confidence, x0 = sample_tokens(mask_logits)
            x_ = torch.zeros_like(x[:, window]) + mask_token_id
            full_confidence = torch.full_like(x[:, window], -torch.inf, dtype=logits.dtype)
            x_[mask_index] = x0.clone()
            full_confidence[mask_index] = confidence
            full_confidence[:, block_length:] = -torch.inf
            current_transfer_tokens = int(
                (x[:, current_block_start:current_block_end] == mask_token_id).sum()
            )
            selected_confidence, select_index = torch.topk(full_confidence, current_transfer_tokens)
            transfer_index = torch.zeros_like(x_, dtype=torch.bool)
            transfer_index[0, select_index[0]] = True
            for k in range(1, current_transfer_tokens):
                if selected_confidence[0, k] < threshold:
                    transfer_index[0, select_index[0, k]] = False
            if bool((x_[transfer_index] == mask_token_id).any()):
                # Fast-dLLM would commit the mask and loop forever; the engine never proposes it.
                raise RuntimeError("the model proposed the mask token")
            x[:, window][transfer_index] = x_[transfer_index]
            if (x[:, current_block_start:current_block_end] == mask_token_id).sum() == 0:
                break
    return x.numpy(), nfe
