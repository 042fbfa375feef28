"""Independent torch reference for Stable-DiffCoder: the checkpoints' remote
`modeling_stable_diffcoder.py` (StableDiffcoderForCausalLM, a LlamaForCausalLM subclass that adds
`_get_num_transfer_tokens`, `_make_block_causal_mask`, `_get_transfer_index` and `generate_block`;
read in the code index, not copied).

* `reference_logits`: transformers' LlamaForCausalLM (eager attention) on the checkpoint's weights
  under a 4-D additive mask: every key (`causal=False`, what the decoders read with `every_key`),
  the causal reading of a plain call (`causal=True`), or generate_block's block-causal mask
  (`block_length=`).
* `generate_block`: the decoding loop, batch of one, written plainly. One deliberate difference:
  upstream keeps a DynamicCache (the prompt's whole blocks prefilled, each step a forward of the
  open block against the cache, cropped back to the block's start, and one more forward of a
  finished block to store its K/V); here every step runs the window x[:, :block_end] under the same
  block-causal mask and keeps the open block's logits, the same computation. The forwards upstream
  counts (its `nfe`: denoising steps and one store per finished block, not the prefill) are
  counted and returned.
"""

import functools

import numpy as np
import torch
import torch.nn.functional as F

# _make_block_causal_mask's pattern (tril over blocks, a block of ones each): SDAR's.
from .hf_body import build_body, keys_in_view, logits_under
from .sdar_torch import block_causal_keep

torch.set_num_threads(1)


@functools.lru_cache(maxsize=2)
def load_reference(ckpt):
    from transformers import LlamaConfig, LlamaForCausalLM

    return build_body(LlamaConfig, LlamaForCausalLM, ckpt, keys=("head_dim",))


def reference_logits(ckpt, input_ids, causal=False, block_length=None):
    """float32 logits (B, L, V) of token ids (module docstring)."""
    x = torch.as_tensor(np.asarray(input_ids)).long()
    L = x.shape[1]
    keep = keys_in_view(L, causal) if block_length is None else block_causal_keep(L, block_length)
    return logits_under(load_reference(str(ckpt)), x, keep).numpy()


def num_transfer_tokens(masks, steps):
    """_get_num_transfer_tokens: masks // steps each step, the first masks % steps one more."""
    counts = torch.full((steps,), masks // steps, dtype=torch.long)
    counts[: masks % steps] += 1
    return counts


def transfer_index(logits, mask_index, x, count, threshold):
    """_get_transfer_index at temperature 0, remasking "low_confidence", shift=False."""
    x0 = torch.argmax(logits, dim=-1)
    p = F.softmax(logits.to(torch.float64), dim=-1)
    x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -np.inf)
    if threshold is not None:
        count = int(mask_index.sum())
    order = torch.topk(confidence[0], k=count).indices
    transfer = torch.zeros_like(x0, dtype=torch.bool)
    transfer[0, order] = True
    if threshold is not None:
        for k in range(1, count):
            if confidence[0, order[k]] < threshold:
                transfer[0, order[k]] = False
    return x0, transfer


def generate_block(
    ckpt,
    prompt,
    steps,
    gen_length,
    block_length=4,
    mask_id=5,
    threshold=None,
    eos_id=None,
    stores=None,
):
    """generate_block at temperature 0: (the sequence it returns, as a list; its nfe). `stores`,
    a list, receives one entry per store forward (a finished block's, counted in the nfe)."""
    model = load_reference(str(ckpt))
    n = len(prompt)
    x = torch.tensor([list(prompt) + [mask_id] * gen_length])
    assert gen_length % block_length == 0
    gen_blocks = gen_length // block_length
    assert steps % gen_blocks == 0
    steps //= gen_blocks
    sizes = [block_length] * gen_blocks
    remainder = n % block_length
    if remainder:
        sizes = [block_length - remainder] + sizes
        sizes[-1] = remainder
    ends = np.cumsum(sizes).tolist()
    keep = block_causal_keep(n + gen_length, block_length)
    prefill = n // block_length * block_length
    nfe = 0
    for i, end in enumerate(ends):
        start = n + ends[i - 1] if i > 0 else prefill
        stop = n + end
        counts = num_transfer_tokens(int((x[:, start:stop] == mask_id).sum()), steps)
        for count in counts.tolist():
            if count > 0:
                nfe += 1
                window = x[:, start:stop]
                mask_map = window == mask_id
                logits = logits_under(model, x[:, :stop], keep[:stop, :stop])[:, start:stop]
                x0, transfer = transfer_index(
                    logits, mask_map, window, count if threshold is None else None, threshold
                )
                window[transfer] = x0[transfer]
            if (x[:, start:stop] == mask_id).sum() == 0:
                gen_start = max(start, n)
                hits = (x[0, gen_start:stop] == eos_id).nonzero() if eos_id is not None else []
                if len(hits):
                    x = x[:, :stop]
                    x[0, gen_start + int(hits[0]) :] = eos_id
                    return x[0].tolist(), nfe
                nfe += 1  # the store forward of the finished block
                if stores is not None:
                    stores.append(stop)
                break
    return x[0].tolist(), nfe
