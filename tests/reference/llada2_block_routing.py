"""Transcription of LLaDA2.2's block expert routing, written plainly in torch (loops over rows and
blocks) for parity tests of the MLX router.

The rule, as the independent implementations state it (the checkpoints' remote
modeling_llada2_moe.py, LLaDA2MoeGate, is not in the public index):
* sgl-project/sglang pull requests #31743 / #31768, python/sglang/srt/models/llada2.py and the test
  oracle `_block_topk_reference` of its block top-k: sigmoid scores plus the expert bias select;
  per block of `block_size` tokens each expert's block score is its maximum over the block; the
  `expert_capacity` best experts (exact torch.topk, which a review of #31768 confirms the released
  code uses) form the block's pool; each token takes its top-k inside the pool; the weights are
  the unbiased sigmoid scores of the chosen experts, renormalised;
* Akicou/diffuse-cpp (commit b799157) src/diffuse-moe-graph.cpp, the MoE layer of its graph
  builder: the same, with the weights scaled by routed_scaling_factor, and no expert groups
  (n_group / topk_group are not used by block routing).
Blocks are counted on positions from 0, as the reference generate's forwards (the window from
position 0) lay them out; the 1e-20 of the renormalisation is LLaDA2MoeGate's (2.0 / 2.1).
"""

import torch


def block_routing(logits, expert_bias, positions, top_k, capacity, block_size, scaling):
    """One row: logits (L, E), positions (L,) ints. Returns (ids (L, top_k), weights (L, top_k))."""
    scores = torch.sigmoid(logits.float())
    routing = scores + expert_bias.float()
    blocks = torch.div(positions, block_size, rounding_mode="floor")
    ids = torch.empty(logits.shape[0], top_k, dtype=torch.long)
    weights = torch.empty(logits.shape[0], top_k)
    for block in blocks.unique().tolist():
        rows = (blocks == block).nonzero().flatten()
        pool = torch.topk(routing[rows].max(dim=0).values, capacity).indices
        for r in rows.tolist():
            inside = torch.full_like(routing[r], float("-inf"))
            inside[pool] = routing[r, pool]
            chosen = torch.topk(inside, top_k).indices
            w = scores[r, chosen]
            if top_k > 1:
                w = w / (w.sum() + 1e-20)
            ids[r], weights[r] = chosen, w * scaling
    return ids, weights
