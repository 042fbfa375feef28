"""Independent torch reference for d3LLM's multi-block decoding (hao-ai-lab/d3LLM @ e5bfcac):

* form="llada": `generate_multi_block` of d3llm/d3llm_LLaDA/d3llm_llada_generate_util.py, with its
  `get_transfer_index_entropy` (lowest-entropy candidate always taken, the others kept at entropy
  <= threshold) and `handle_early_stop`;
* form="dream": `DreamGenerationMixin._sample_multi_block` of
  d3llm/d3llm_DREAM/d3llm_dream_generate_util.py (`alg="entropy_threshold"`: entropy < threshold;
  logits shifted right by one; attention "full").

A plain transcription of the loop (block states, activation, block adding, forced decode, early
stop), batch size 1 as the reference, with `forward(x) -> logits` in place of the model. It returns
the sequence, the reference's own `nfe` counter, the number of forwards actually run (the counter
counts the iteration that early stop ends before its forward) and how many times a step committed the
mask token itself (its argmax is over the whole vocabulary; such a position stays masked and is
decoded again later, where this package never proposes the mask id).
"""

import numpy as np
import torch
import torch.nn.functional as F


def _entropy(logits):
    p = F.softmax(logits.to(torch.float64), dim=-1)
    return -torch.sum(p * torch.log(p + 1e-12), dim=-1)


def _transfer_llada(logits, mask_index, x, threshold):
    """get_transfer_index_entropy at temperature 0, remasking="low_confidence"."""
    x0 = torch.argmax(logits, dim=-1)
    entropy = _entropy(logits)
    x0 = torch.where(mask_index, x0, x)
    selection = torch.where(mask_index, entropy, torch.inf)
    transfer = torch.zeros_like(x0, dtype=torch.bool)
    k = int(mask_index.sum())
    _, select = torch.topk(selection[0], k=k, largest=False)
    transfer[0, select] = True
    for j in range(1, k):  # the first (lowest entropy) is always kept
        if entropy[0, select[j]] > threshold:
            transfer[0, select[j]] = False
    return x0, transfer, entropy


def _transfer_dream(logits, mask_index, threshold):
    entropy = _entropy(logits)
    x0 = torch.argmax(logits, dim=-1)
    return x0, (entropy < threshold) & mask_index, entropy


def _early_stop(x, states, eos, prompt_len, mask_id):
    """handle_early_stop: the first EOS of the generated region; everything after it becomes EOS;
    the blocks' mask counts follow."""
    gen = x[:, prompt_len:]
    hits = (gen == eos).nonzero()
    if hits.numel() == 0:
        return None
    first = prompt_len + int(hits[:, 1].min())
    x[:, first + 1 :] = eos
    for bid in sorted(states):
        if bid > 0:
            s = states[bid]
            s["mask_count"] = int((x[:, s["start"] : s["end"]] == mask_id).sum())
            if s["mask_count"] == 0:
                s["is_complete"] = True
    return first


def _progress(states, bid):
    return 1 - states[bid]["mask_count"] / states[bid]["total_masks"]


def _new_block(states, bid, plen, block_size, max_new_tokens, mask_count, complete):
    start = plen + (bid - 1) * block_size
    end = min(start + block_size, plen + max_new_tokens)
    states[bid] = dict(
        start=start, end=end, mask_count=mask_count, total_masks=end - start,
        is_complete=complete,
    )  # fmt: skip


def _update_block_activation_states(states, decoded_token_threshold):
    """A block becomes complete (fully decodable) once its predecessor is decoded enough."""
    for bid in sorted(states):
        if bid > 0 and not states[bid]["is_complete"]:
            if _progress(states, bid - 1) >= decoded_token_threshold:
                states[bid]["is_complete"] = True


def _rightmost_active(states):
    rightmost = 0
    for bid in sorted(states):
        if states[bid]["is_complete"] or states[bid]["mask_count"] > 0:
            rightmost = bid
    return rightmost


def _force_decode(states, transfer, x0, decode, entropy, logits, form):
    """The first complete block that still has masks decodes at least its lowest-entropy one."""
    first_full = None
    for bid in sorted(states):
        if bid > 0 and states[bid]["is_complete"] and states[bid]["mask_count"] > 0:
            first_full = bid
            break
    if first_full is not None:
        start, end = states[first_full]["start"], states[first_full]["end"]
        if not transfer[:, start:end].any():
            h = torch.where(decode[:, start:end], entropy[:, start:end], torch.inf)
            best = int(h[0].argmin())
            transfer[0, start + best] = True
            if form == "llada":  # the reference re-reads the argmax there
                x0[0, start + best] = torch.argmax(logits[0, start + best], dim=-1)


def _count_transfers(states, transfer):
    for bid in sorted(states):
        if bid > 0 and states[bid]["mask_count"] > 0:
            s = states[bid]
            s["mask_count"] -= int(transfer[:, s["start"] : s["end"]].sum())


def multi_block_generate(
    forward,
    prompt,
    max_new_tokens,
    *,
    form,
    mask_id,
    block_size=32,
    threshold=0.5,
    block_add_threshold=0.1,
    decoded_token_threshold=0.95,
    eos_token_id=None,
    early_stop=False,
):
    """(sequence (L,) int64, nfe as the reference counts it, forwards run, mask commits)."""
    prompt = torch.as_tensor(np.asarray(prompt)).long().reshape(1, -1)
    plen = prompt.shape[1]
    x = torch.full((1, plen + max_new_tokens), mask_id, dtype=torch.long)
    x[:, :plen] = prompt
    if not early_stop:
        eos_token_id = None
    states = {0: dict(start=0, end=plen, mask_count=0, total_masks=plen, is_complete=True)}
    num_blocks = max_new_tokens // block_size

    def new_block(bid, mask_count, complete):
        _new_block(states, bid, plen, block_size, max_new_tokens, mask_count, complete)

    next_bid = 1
    if next_bid <= num_blocks:
        new_block(1, block_size, 1.0 >= decoded_token_threshold)
        next_bid += 1
    nfe = forwards = mask_commits = 0
    has_eos = False
    while True:
        mask_index = x == mask_id
        if mask_index[:, plen:].sum() == 0 and next_bid > num_blocks:
            break
        nfe += 1
        if eos_token_id is not None:
            first = _early_stop(x, states, eos_token_id, plen, mask_id)
            has_eos = first is not None
            if has_eos:
                while next_bid <= num_blocks:
                    if plen + (next_bid - 1) * block_size > first:
                        new_block(next_bid, 0, True)
                        next_bid += 1
                    else:
                        break
                if (x == mask_id)[:, plen:].sum() == 0:
                    break
        _update_block_activation_states(states, decoded_token_threshold)
        if next_bid <= num_blocks and not has_eos:
            last = max(states)
            if last > 0 and (
                _progress(states, last) >= block_add_threshold or states[last]["mask_count"] == 0
            ):
                start = plen + (next_bid - 1) * block_size
                end = min(start + block_size, plen + max_new_tokens)
                if end > start:
                    count = int((x[:, start:end] == mask_id).sum())
                    new_block(
                        next_bid, count, _progress(states, next_bid - 1) >= decoded_token_threshold
                    )
                    next_bid += 1
        rightmost = _rightmost_active(states)
        if rightmost == 0:
            break
        active_end = states[rightmost]["end"]
        logits = torch.as_tensor(np.asarray(forward(x))).float()
        forwards += 1
        if form == "dream":
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        decode = mask_index.clone()
        decode[:, active_end:] = False
        if form == "llada":
            x0, transfer, entropy = _transfer_llada(logits, decode, x, threshold)
        else:
            x0, transfer, entropy = _transfer_dream(logits, decode, threshold)
        _force_decode(states, transfer, x0, decode, entropy, logits, form)
        mask_commits += int((transfer & (x0 == mask_id)).sum())
        x[transfer] = x0[transfer]
        _count_transfers(states, transfer)
        if nfe > 10000:
            break
    return x[0].numpy().astype(np.int64), nfe, forwards, mask_commits
