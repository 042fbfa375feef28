"""Independent torch reference for dllm's A2D Qwen3 / Qwen2 checkpoints (ZHZisZZ/dllm @ ca17675).

* `reference_logits`: transformers' Qwen3ForCausalLM (eager attention) on the checkpoint's weights,
  its config relabelled qwen3, under the mask A2DQwen3Model.forward builds
  (dllm/pipelines/a2d/models/qwen3/modeling_qwen3.py): the 2-D padding mask expanded by
  `_prepare_4d_attention_mask` (every query sees every real key, none sees padding), positions
  0..L-1 (cache_position; the padding is on the right).
* `get_num_transfer_tokens`: dllm/core/samplers/utils.py with LinearAlphaScheduler
  (dllm/core/schedulers/alpha.py) inlined: the float32 reverse_mask_prob, float64 product,
  torch.round, zero steps removed per row and rows right-padded with zeros.
* `mdlm_sample`: MDLMSampler.sample (dllm/core/samplers/mdlm.py) transcribed for remasking
  "low_confidence", no guidance, no suppressed tokens, right_shift_logits off: the canvas filled
  with EOS, each row's prompt then max_new_tokens masks, attention over those only; blocks counted
  from each row's prompt end; steps per block = ceil(steps / num_blocks); add_gumbel_noise
  (samplers/utils.py: exp(logits) / (-log u) ** temperature in float64) at temperature > 0, whose
  uniform draws `uniform(forward, block, shape)` supplies (the seam a test fills with the engine's).
"""

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from .hf_body import load_relabelled, logits_under

torch.set_num_threads(1)


@functools.lru_cache(maxsize=4)
def load_reference(ckpt):
    def fields(cfg):
        # a2d-qwen3 / a2d-qwen2: transformers' own class of the source model.
        base = cfg["model_type"].removeprefix("a2d-")
        cls = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[base]
        return dict(model_type=base, architectures=[cls])

    return load_relabelled(ckpt, fields, drop=("mask_token_id",))


def _logits(model, x, attention_mask=None, causal=False):
    B, L = x.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, L, dtype=torch.long)
    # _prepare_4d_attention_mask: (1 - mask) * finfo.min, expanded over the queries.
    keep = attention_mask.bool()[:, None, None, :].expand(B, 1, L, L)
    if causal:
        keep = keep & torch.tril(torch.ones(L, L, dtype=torch.bool))
    return logits_under(model, x, keep)


def reference_logits(ckpt, input_ids, attention_mask=None, causal=False):
    """Float32 logits (B, L, V); `causal=True` is Qwen3's own reading, which A2D must not match."""
    x = torch.as_tensor(np.asarray(input_ids)).long()
    if attention_mask is not None:
        attention_mask = torch.as_tensor(np.asarray(attention_mask)).long()
    return _logits(load_reference(str(ckpt)), x, attention_mask, causal).numpy()


def reference_forward(ckpt):
    """`forward(x, attention_mask) -> logits` for `mdlm_sample`."""
    model = load_reference(str(ckpt))
    return lambda x, attention_mask: _logits(model, x, attention_mask)


# --- dllm/core/schedulers/alpha.py, dllm/core/samplers/utils.py ------------------------------


def _linear_alpha(i):
    return 1 - torch.as_tensor(i, dtype=torch.float32)


def _reverse_mask_prob(s, t):
    out = (1 - _linear_alpha(s)) / (1 - _linear_alpha(t))
    return out.item()


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    num = torch.zeros(mask_num.size(0), steps, dtype=torch.int64)
    for i in range(mask_num.size(0)):
        for t, s, j in zip(range(steps, 0, -1), range(steps - 1, -1, -1), range(steps)):
            s /= steps
            t /= steps
            prob = 1 - _reverse_mask_prob(s, t)
            x = mask_num[i, 0].to(torch.float64) * prob
            num[i, j] = torch.round(x).to(torch.int64)
            num[i, j] = torch.minimum(num[i, j], mask_num[i, 0])
            mask_num[i, 0] -= num[i, j]
            if mask_num[i, 0].item() == 0:
                break
    rows = [r[r > 0] for r in num]
    width = max(r.numel() for r in rows)
    return torch.stack(
        [torch.cat([r, torch.zeros(width - r.numel(), dtype=r.dtype)]) for r in rows]
    )


# --- dllm/core/samplers/mdlm.py: MDLMSampler.sample ------------------------------------------


def add_gumbel_noise(logits, temperature, u):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    return logits.exp() / (-torch.log(u.to(torch.float64))) ** temperature


def mdlm_sample(
    forward,
    prompts,
    max_new_tokens,
    block_size,
    steps,
    *,
    mask_id,
    eos_id,
    temperature=0.0,
    uniform=None,
):
    """-> (B, T) int64: each row's prompt, its max_new_tokens decoded, EOS after. `steps` is dllm's
    total; `forward(x, attention_mask)` returns logits."""
    prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    prompt_lens = [p.shape[0] for p in prompts]
    B, T = len(prompts), max_new_tokens + max(prompt_lens)
    x = torch.full((B, T), eos_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, : prompt_lens[i]] = p
        x[i, prompt_lens[i] : prompt_lens[i] + max_new_tokens] = mask_id
        attention_mask[i, : min(prompt_lens[i] + max_new_tokens, T)] = 1
    num_blocks = math.ceil(max_new_tokens / block_size)
    steps = math.ceil(steps / num_blocks)
    n_forward = 0
    for b in range(num_blocks):
        block_mask_index = torch.zeros((B, block_size), dtype=torch.bool)
        for j in range(B):
            start = prompt_lens[j] + b * block_size
            end = min(start + block_size, prompt_lens[j] + max_new_tokens, T)
            if start < end:
                block_mask_index[j, : end - start] = x[j, start:end] == mask_id
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)
        for i in range(num_transfer_tokens.size(1)):
            mask_index = x == mask_id
            logits = forward(x, attention_mask)
            u = uniform(n_forward, b, logits.shape) if temperature > 0 else None
            n_forward += 1
            x0 = torch.argmax(add_gumbel_noise(logits, temperature, u), dim=-1)
            p = F.softmax(logits, dim=-1)
            x0_p = torch.gather(p, dim=-1, index=x0[..., None]).squeeze(-1)
            for j in range(B):
                x0_p[j, prompt_lens[j] + (b + 1) * block_size :] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(B):
                _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j, i]))
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


# --- dllm/core/samplers/bd3lm.py: BD3LMSampler.sample ----------------------------------------


def _prepare_for_sampling(x, block_size, pad_id):
    """Block-causal keep-mask [B, 1, T, T] on columns (padding neither query nor key) and the
    logical positions (padding skipped), as bd3lm.py's `_prepare_for_sampling`."""
    B, T = x.shape
    valid = x != pad_id
    logical = torch.cumsum(valid.long(), dim=-1) - 1
    position_ids = torch.where(valid, logical, torch.zeros_like(logical))
    block_ids = (torch.arange(T) // block_size).view(1, T).expand(B, -1)
    block_ids = torch.where(valid, block_ids, torch.full_like(block_ids, -1))
    bid_q, bid_k = block_ids.view(B, 1, T, 1), block_ids.view(B, 1, 1, T)
    return (bid_k <= bid_q) & (bid_q >= 0) & (bid_k >= 0), position_ids


def _additive(keep):
    # The checkpoint runs sdpa with this boolean mask; eager attention adds its mask, so the same
    # mask is given additively (a fully hidden padding query row comes out uniform; unread).
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


def bd3lm_sample(ckpt, prompts, max_new_tokens, block_size, steps, *, mask_id, pad_id, eos_id):
    """-> (B, T) int64: left-padded prompts (pad_id, to whole blocks) and the generated blocks;
    stops once every row has an EOS in a finished block. `steps` is dllm's total. remasking
    "low_confidence", temperature 0, no guidance, right_shift_logits off."""
    import copy

    model = load_reference(str(ckpt))
    prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    prompt_lens = [p.shape[0] for p in prompts]
    B = len(prompts)
    padded = (max(prompt_lens) + block_size - 1) // block_size * block_size
    x = torch.full((B, padded), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        x[b, padded - prompt_lens[b] :] = p
    done = torch.zeros(B, dtype=torch.bool)
    num_blocks = math.ceil(max_new_tokens / block_size)
    steps_per_block = math.ceil(steps / num_blocks)
    generated = 0
    for _ in range(num_blocks):
        if done.all():
            break
        cur = min(block_size, max_new_tokens - generated)
        t_prefix = x.shape[1]
        keep, pos = _prepare_for_sampling(x, block_size, pad_id)
        with torch.no_grad():
            past = model(
                x, attention_mask=_additive(keep), position_ids=pos, use_cache=True
            ).past_key_values
        x = torch.cat([x, torch.full((B, cur), mask_id, dtype=torch.long)], dim=1)
        num_transfer = get_num_transfer_tokens(x[:, -cur:] == mask_id, steps_per_block)
        keep, pos = _prepare_for_sampling(x, block_size, pad_id)
        attn_block, pos_block = _additive(keep[:, :, t_prefix:]), pos[:, t_prefix:]
        for i in range(num_transfer.size(1)):
            x_block = x[:, t_prefix:]
            mask_block = x_block == mask_id
            if not mask_block.any():
                break
            with torch.no_grad():
                logits = model(
                    x_block,
                    attention_mask=attn_block,
                    position_ids=pos_block,
                    past_key_values=copy.deepcopy(past),
                    use_cache=False,
                ).logits.float()
            x0 = torch.argmax(logits, dim=-1)
            x0_p = torch.gather(F.softmax(logits, dim=-1), -1, x0[..., None]).squeeze(-1)
            x0 = torch.where(mask_block, x0, x_block)
            confidence = torch.where(mask_block, x0_p, torch.full_like(x0_p, -float("inf")))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(B):
                k = int(num_transfer[j, i])
                valid = int((confidence[j] > -float("inf")).sum())
                if k <= 0 or valid == 0:
                    continue
                _, sel = torch.topk(confidence[j], min(k, valid))
                transfer[j, sel] = True
            x_block = x_block.clone()
            x_block[transfer] = x0[transfer]
            x[:, t_prefix:] = x_block
        done = done | (x[:, t_prefix:] == eos_id).any(dim=1)
        generated += cur
    return x, padded
