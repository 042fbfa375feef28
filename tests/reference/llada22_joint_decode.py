"""Transcription of LLaDA2.2's decoding loop (`LLaDA2MoeModelLM.generate` ->
`_joint_decode_block` -> `_apply_edit_operations_with_tracking` in the checkpoint's remote
modeling_llada2_moe.py, lines ~1649 / ~1389 / ~1249), batch of one, greedy, written plainly in
torch for token parity tests.

The checkpoint file is not stored anywhere readable here; this follows the port whose code is
closest to it, FLX-OSS/FluxServe python/fluxserve/backend/execution/decoders/levenshtein.py
(`apply_edit_operations`, "direct port" of `_apply_edit_operations_with_tracking`;
`levenshtein_graph_step`, the loop body) whose tests drive the checkpoint's own
`_joint_decode_block`, corroborated by sgl-project/sglang PR #31773 (`JointThresholdInDel.step`,
`_apply_edit_operations`) and by FluxServe's dev-notes/llada2.2-model-support-development-guide.md
section 5 (the loop's termination). Left out: the reference's anti-loop resampling (a random
changed position of a repeated state is resampled); trace["repeats"] counts the steps where it
would have fired, which the tests require to be 0.

`forward(ids, keep) -> logits` as in llada2_generate.py. Returns (generated ids up to and including
the first EOS, forwards, trace): trace holds the canvas after each step (every position past the
prompt) and counts of the DELETE / SPLIT tokens consumed.
"""

import torch

from .llada2_generate import block_causal_keep, generated_answer, sample


def apply_edits(tokens, old, original, mask_id, delete_id, split_id):
    """`_apply_edit_operations_with_tracking` over one block (lists)."""
    out, flags = [], []
    for i, token in enumerate(tokens):
        if token == delete_id:
            continue
        if token == split_id:
            out += [mask_id, old[i]]
            flags += [False, original[i]]
        else:
            out.append(token)
            flags.append(original[i])
    length = len(tokens)
    out, flags = out[:length], flags[:length]
    pad = length - len(out)
    return out + [mask_id] * pad, flags + [False] * pad


def schedule(initial, steps):
    out = [initial // steps] * steps
    for i in range(initial % steps):
        out[i] += 1
    return out


@torch.no_grad()
def joint_decode_block(forward, x, start, end, prompt_in_block, keep, settings, trace):
    """One block of `x` (1, T) in place; returns the forwards it took."""
    mask_id, delete_id, split_id = settings["mask_id"], settings["delete_id"], settings["split_id"]
    steps, max_post = settings["steps"], settings["max_post_steps"]
    cap = settings["max_steps_per_block"]
    cur = x[:, :end]
    block = cur[0, start:end]
    original = (block == mask_id).tolist()
    plan = schedule(sum(original), steps)
    if not any(original):
        return 0
    post = forwards = 0
    seen = set()
    for step in range(cap):
        masks = block == mask_id
        n_orig = sum(m and o for m, o in zip(masks.tolist(), original))
        n_new = int(masks.sum()) - n_orig
        post = post + 1 if n_orig == 0 else 0
        if not masks.any() and post > max_post:
            break
        logits = forward(cur, keep[:end, :end])[0, start:end]
        forwards += 1
        x0, p = sample(logits, 0.0, None, None, argmax_of="logits")
        fill = torch.zeros_like(masks)
        if masks.any():
            if step >= steps:
                fill = masks.clone()
            else:
                need = plan[step] + n_new
                conf = torch.where(masks, p, -torch.inf)
                high = (conf > settings["threshold"]) & masks
                if int(high.sum()) >= need:
                    fill = high
                elif need > 0:
                    fill[torch.topk(conf, k=min(need, int(masks.sum()))).indices] = True
        # Final round: the last step before the budget stops the loop (no original mask left
        # after this fill, the next post count above max_post_steps; FluxServe's
        # levenshtein_graph_step, both of its branches), or the step cap.
        left = any(f and o for f, o in zip((masks & ~fill).tolist(), original))
        final = (not left and post + 1 > max_post) or step >= cap - 1
        if final:
            fill = masks.clone()
        editable = ~masks & ~prompt_in_block
        edit = (torch.where(editable, p, -torch.inf) > settings["editing_threshold"]) & editable
        edit &= x0 != block
        if final:  # no DELETE / SPLIT in the final round: the block ends resolved
            control = (x0 == delete_id) | (x0 == split_id)
            alt = logits.clone()
            alt[:, [delete_id, split_id]] = -torch.inf
            x0 = torch.where(control, alt.argmax(-1), x0)
        old = block.tolist()
        written = torch.where(fill | edit, x0, block).tolist()
        trace["repeats"] += (not final and tuple(written) in seen) and written != old
        seen.add(tuple(written))
        trace["deletes"] += written.count(delete_id)
        trace["splits"] += written.count(split_id)
        new, original = apply_edits(written, old, original, mask_id, delete_id, split_id)
        block[:] = torch.tensor(new)
        trace["canvas"].append(x[0, settings["prompt_length"] :].tolist())
        if not masks.any() and new == old:
            break
    return forwards


@torch.no_grad()
def llada22_generate(forward, prompt, gen_length, block_length=32, **settings):
    """`generate` at its defaults (threshold 0.5, editing_threshold 0.0, block 32, steps 32,
    max_post_steps 16, max_steps_per_block 1000, temperature 0)."""
    s = dict(threshold=0.5, editing_threshold=0.0, steps=32, max_post_steps=16)
    s.update(max_steps_per_block=1000, **settings)
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    keep = block_causal_keep(total, block_length)
    x = torch.full((1, total), s["mask_id"], dtype=torch.long)
    x[:, :prompt_length] = prompt
    trace = {"canvas": [], "deletes": 0, "splits": 0, "repeats": 0}
    s["prompt_length"] = prompt_length
    forwards = 0
    for b in range(prompt_length // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        in_prompt = torch.arange(start, end) < prompt_length
        forwards += joint_decode_block(forward, x, start, end, in_prompt, keep, s, trace)
    return generated_answer(x, prompt_length, gen_length, s["eos_id"]), forwards, trace
