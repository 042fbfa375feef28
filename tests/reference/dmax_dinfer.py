"""Independent reference for DMax's soft parallel decoding: a plain torch transcription of the
authors' dInfer loop (czg1225/DMax @ 82bc29ec433d94b3e53dfcf1626f34d62bf5a885,
dInfer/python/dinfer/decoding/generate_uniform.py: `BlockDiffusionLLM.naive_batching_generate_uniform`,
`BlockDiffusionRunner.decode_uniform`, `BlockDiffusionIteration.forward_uniform`;
parallel_strategy.py: `get_transfer_index_uniform`, `ThresholdParallelDecoder.decode_uniform`),
batch of one, temperature 0, top_k 1, as its evaluation scripts run it; read in the code index, not
copied.

The arithmetic is an `ops` object's (TorchOps: torch on the caller's forward and embedding table):
`forward(prefix_ids, block) -> logits` gives the block's (1, L, V) logits, `block` being its token
ids (1, L) or its input embeddings (1, L, H), against the prefix under the block-causal mask;
`embed(ids)`, `stats(logits) -> (argmax, its probability)` and `mix(probability, argmax)` (the soft
embeddings) complete it. One deliberate difference: dInfer keeps a prefix K/V cache (the prompt's
whole blocks prefilled, and a finished block's K/V written by the next block's first forward over
both blocks); TorchOps's forward recomputes the prefix from its token ids, the same computation.
The forwards dInfer counts (`num_forwards`: the prefill, even of a prompt shorter than a block, and
every block forward) are counted and returned.
"""

import torch


def transfer_index_uniform(probs, mask_index, threshold):
    """get_transfer_index_uniform's selection: the masks before the first one below threshold,
    else the first mask."""
    confidence = torch.where(mask_index, probs, torch.tensor(float("-inf")))
    is_low = mask_index & (confidence < threshold)
    failed = torch.cumsum(is_low.long(), dim=1) > 0
    candidates = mask_index & ~failed
    first_mask = (torch.cumsum(mask_index.long(), dim=1) == 1) & mask_index
    return torch.where(candidates.any(dim=-1, keepdim=True), candidates, first_mask)


def soft_mix(max_probs, max_indices, embedding, mask_id):
    """decode_uniform's top-1 soft embeddings of every position."""
    topk_probs = max_probs.unsqueeze(-1)
    topk_embeds = embedding[max_indices.unsqueeze(-1)]  # (1, L, 1, H)
    residual = torch.clamp(1.0 - topk_probs.sum(dim=-1, keepdim=True), min=0.0)
    mask_embed = embedding[torch.tensor([mask_id])].unsqueeze(0)
    mask_norm = torch.norm(mask_embed, p=2, dim=-1, keepdim=True)
    soft = (topk_embeds * topk_probs.unsqueeze(-1)).sum(dim=2) + mask_embed * residual
    current = torch.norm(soft, p=2, dim=-1, keepdim=True)
    target = (torch.norm(topk_embeds, p=2, dim=-1) * topk_probs).sum(dim=-1, keepdim=True)
    target = target + mask_norm * residual
    return soft * (target / (current + 1e-6))


class TorchOps:
    """The arithmetic in torch (float32, as _get_prob_stats reads logits) on `forward` and the
    embedding `table`."""

    def __init__(self, forward, table, mask_id):
        self.forward, self.table, self.mask_id = forward, table, mask_id

    def embed(self, ids):
        return self.table[ids]

    def stats(self, logits):
        logits = logits.float()
        x0 = torch.argmax(logits, dim=-1)
        chosen = torch.gather(logits, -1, x0.unsqueeze(-1)).squeeze(-1)
        return x0, torch.exp(chosen - torch.logsumexp(logits, dim=-1))

    def mix(self, max_probs, x0):
        return soft_mix(max_probs, x0, self.table, self.mask_id)


def decode_uniform(ops, logits, x_block, active, prev, mask_id, threshold):
    """One ThresholdParallelDecoder.decode_uniform: updates x_block in place; (stop, embeddings)."""
    x0, max_probs = ops.stats(logits)
    mask_index = x_block == mask_id
    high = transfer_index_uniform(max_probs, mask_index, threshold)
    if mask_index.any():
        update = high | (active & ~mask_index)
    else:
        update = active
    changed = update & (x0 != x_block)
    x_block[update] = x0[update]
    if (max_probs[active] >= 0.9).all() or not changed.any():
        return True, prev
    soft_cond = active & (x_block != mask_id)
    if prev is None:
        base = ops.embed(x_block).clone()
    else:
        base = prev.clone()
        refresh = ~soft_cond & changed
        base[refresh] = ops.embed(x_block[refresh])
    if not soft_cond.any():
        return False, base
    soft = ops.mix(max_probs, x0)
    base[soft_cond] = soft[soft_cond].to(base.dtype)
    return False, base


def generate(ops, prompt, gen_length, block_length, mask_id, eos_id, threshold):
    """naive_batching_generate_uniform, one row: (the tokens after the prompt, up to and including
    the first EOS; its num_forwards)."""
    n = len(prompt)
    num_blocks = (n + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[0, :n] = torch.tensor(prompt)
    nfe = 1  # the prefill of max(whole prompt blocks, one block)
    start = n // block_length * block_length
    while start < total:
        stop = start + block_length
        active = x[:, start:stop] == mask_id
        embeddings = None
        for _ in range(block_length):
            block = x[:, start:stop] if embeddings is None else embeddings
            logits = ops.forward(x[:, :start], block)
            nfe += 1
            block_ids = x[:, start:stop].clone()
            done, embeddings = decode_uniform(
                ops, logits, block_ids, active, embeddings, mask_id, threshold
            )
            x[:, start:stop] = block_ids
            if done:
                break
        if (x[0, start:stop] == eos_id).any():
            break
        start = stop
    out = x[0, n:].tolist()
    if eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return out, nfe
