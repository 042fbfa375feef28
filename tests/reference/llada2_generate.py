"""Transcriptions of the LLaDA2.0 and LLaDA2.1 reference decoding loops (`LLaDA2MoeModelLM.generate`
in the Hugging Face remote code, as copied in ZHZisZZ/dllm dllm/pipelines/llada2 and llada21),
batch of one, written plainly in torch for token parity tests.

They take `forward(ids, keep) -> logits`: ids (1, L) over the window x[:, :(b+1)*B], keep the
(L, L) boolean block-causal mask (the reference adds its log as a bfloat16 additive mask),
logits (1, L, V). Each step recomputes the whole window, as the reference does (it has no cache).
Both return (generated ids up to and including the first EOS, number of forwards); 2.1 also the
number of edits that wrote the mask token: its proposals are not kept from the mask id, so an edit
can turn a committed token back into a mask (the engine never proposes the mask id).
"""

import torch
import torch.nn.functional as F

# Top-k / top-p filtering, the per-step commit counts and the block-causal keep are the same
# functions as in the transcription of SDAR's generate.py.
from .sdar_generate import block_causal_keep, num_transfer_tokens, top_k_logits, top_p_logits


def sample(logits, temperature, top_k, top_p, argmax_of="probs"):
    """(token, probability): greedy at temperature 0 (argmax of the probabilities in 2.0, of the
    logits in 2.1; probability from the unfiltered softmax), else temperature, top-k, top-p,
    multinomial."""
    shape = logits.shape[:-1]
    logits = logits.reshape(-1, logits.shape[-1]).float()
    if temperature == 0.0:
        probs = F.softmax(logits, dim=-1)
        token = torch.argmax(probs if argmax_of == "probs" else logits, dim=-1, keepdim=True)
        return token.view(shape), torch.gather(probs, -1, token).view(shape)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_logits(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    token = torch.multinomial(probs, num_samples=1)
    return token.view(shape), torch.gather(probs, -1, token).view(shape)


def generated_answer(x, prompt_length, gen_length, eos_id):
    answer = x[0, prompt_length : prompt_length + gen_length]
    eos = (answer == eos_id).nonzero()
    end = int(eos[0, 0]) + 1 if len(eos) else gen_length
    return answer[:end]


@torch.no_grad()
def llada20_generate(
    forward,
    prompt,
    temperature=0.0,
    block_length=32,
    steps=32,
    gen_length=2048,
    top_p=None,
    top_k=None,
    minimal_topk=1,
    threshold=0.95,
    eos_id=156892,
    mask_id=156895,
):
    """LLaDA2.0: per block, up to `steps` forwards; the masks above `threshold` (strict) are
    committed when there are at least the step's quota of them, else the quota's most confident;
    stop after a block once the generated region holds an EOS."""
    steps = min(steps, gen_length // minimal_topk)
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    keep = block_causal_keep(total_length, block_length)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt
    schedule = num_transfer_tokens(block_length, steps)
    forwards = 0
    for num_block in range(prompt_length // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:, :end]
        for step in range(steps):
            active = cur_x[:, -block_length:] == mask_id
            if active.sum() == 0:
                break
            logits = forward(cur_x, keep[:end, :end])[:, -block_length:]
            forwards += 1
            x0, x0_p = sample(logits, temperature, top_k, top_p)
            k = int(schedule[step])
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            confidence = torch.where(active, x0_p, -torch.inf)
            high = confidence[0] > threshold
            if int(high.sum()) >= k:
                transfer[0] = high
            else:
                idx = torch.topk(confidence[0], k=min(k, int(active.sum()))).indices
                transfer[0, idx] = True
            if transfer.any():
                cur_x[:, -block_length:][transfer] = x0[transfer]
        x[:, :end] = cur_x
        if (x[0, prompt_length:end] == eos_id).any():
            break
    return generated_answer(x, prompt_length, gen_length, eos_id), forwards


@torch.no_grad()
def llada21_generate(
    forward,
    prompt,
    temperature=0.0,
    block_length=32,
    steps=32,
    gen_length=2048,
    top_p=None,
    top_k=None,
    minimal_topk=1,
    threshold=0.95,
    editing_threshold=0.9,
    max_post_steps=16,
    eos_id=156892,
    mask_id=156895,
    num_to_transfer=1,
):
    """LLaDA2.1: mask-to-token commits as 2.0 but with a fixed quota `num_to_transfer` (the step
    budget is unused), plus token-to-token edits of the block's committed, non-prompt positions
    whose proposal differs with probability above `editing_threshold`; after the block has no masks
    up to `max_post_steps` more forwards, stopping at one that edits nothing. No EOS stop (the
    reference's eos_early_stop is off by default)."""
    steps = min(steps, gen_length // minimal_topk)  # noqa: F841  (as the reference: unused)
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    keep = block_causal_keep(total_length, block_length)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt
    forwards = remasked = 0
    for num_block in range(prompt_length // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:, :end]
        block_start = num_block * block_length
        prompt_in_block = torch.zeros(block_length, dtype=torch.bool)
        if block_start < prompt_length:
            prompt_in_block[: min(prompt_length - block_start, block_length)] = True
        post_steps = 0
        while True:
            old = cur_x[:, -block_length:].clone()
            active = old == mask_id
            if not active.any():
                post_steps += 1
            if post_steps > max_post_steps:
                break
            logits = forward(cur_x, keep[:end, :end])[:, -block_length:]
            forwards += 1
            x0, x0_p = sample(logits, temperature, top_k, top_p, argmax_of="logits")
            fill = torch.zeros_like(x0, dtype=torch.bool)
            if active.sum() > 0:
                confidence = torch.where(active, x0_p, -torch.inf)
                high = (confidence[0] > threshold) & active[0]
                if int(high.sum()) >= num_to_transfer:
                    fill[0] = high
                else:
                    idx = torch.topk(
                        confidence[0], k=min(num_to_transfer, int(active.sum()))
                    ).indices
                    fill[0, idx] = True
            editable = ~active & ~prompt_in_block[None, :]
            edit = (
                (torch.where(editable, x0_p, -torch.inf) > editing_threshold)
                & editable
                & (x0 != old)
            )
            transfer = fill | edit
            remasked += int((edit & (x0 == mask_id)).sum())
            if transfer.any():
                cur_x[:, -block_length:][transfer] = x0[transfer]
            if active.sum() == 0 and not edit.any():
                break
        x[:, :end] = cur_x
    return generated_answer(x, prompt_length, gen_length, eos_id), forwards, remasked
