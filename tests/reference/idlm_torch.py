"""Torch transcription of I-DLM's Introspective Strided Decoding at temperature 0 (thuEcstasy/I-DLM
@ 3342a17bf51df3d2a73d589f0a8c7f3e326f8828, inference/sglang/sglang/srt/dllm/algorithm/
idlm_blockN.py, `IDLMBlockN.run`'s greedy path), on transformers' Qwen3 forward of the published
SDAR-layout checkpoint (transformers' Qwen3ForCausalLM over its weights, as reference/sdar_torch.py
loads SDAR's) under a causal mask (`dllm_force_causal`).

The reference keeps a paged K/V cache and trims the positions it drops after each forward; under
causal attention that equals recomputing the kept sequence, which this transcription does: each
forward runs over [kept tokens ; the round's block] and reads the block's rows.
"""

import functools

import numpy as np
import torch

from .hf_body import keys_in_view, load_relabelled, logits_under

QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"])


@functools.lru_cache(maxsize=4)
def load_reference(ckpt):
    """The published ("sdar") or converted ("idlm") checkpoint as transformers' Qwen3."""
    return load_relabelled(ckpt, QWEN3, drop=("auto_map", "block_size", "mask_token_id"))


def reference_logits(ckpt, input_ids, causal=False):
    """float32 logits (B, L, V) with every key in view, or (`causal`) under the causal mask."""
    x = torch.as_tensor(np.asarray(input_ids)).long()
    return logits_under(load_reference(str(ckpt)), x, keys_in_view(x.shape[1], causal)).numpy()


def causal_logits(ckpt, ids):
    """float32 logits (B, L, V) of I-DLM's causal forward over `ids` (B, L)."""
    return reference_logits(ckpt, ids, causal=True)


def isd_generate(ckpt, prompt, max_new_tokens, gen_block_size, mask_id, eos_ids):
    """(new tokens cut before the first EOS, forwards): the prefill forward, then one forward a
    round: cold start [t0, M x (2N - 2)] or verify [pending, N - 1 specs, M x (N - 1)]."""
    n, blk = gen_block_size, 2 * gen_block_size - 1
    kept = [int(t) for t in prompt]
    forwards = 1
    prev_argmax = int(np.argmax(causal_logits(ckpt, [kept])[0, -1]))
    pending, specs, forced, out = None, [], None, []
    while True:
        if pending is not None and specs:
            block = [pending] + specs + [mask_id] * (blk - 1 - len(specs))
        else:
            t0 = forced if forced is not None else prev_argmax
            block = [t0] + [mask_id] * (blk - 1)
        lg = causal_logits(ckpt, [kept + block])[0, len(kept) :]
        forwards += 1
        argmax = [int(t) for t in np.argmax(lg, axis=-1)]
        if pending is not None and specs:
            si = next((i for i, s in enumerate(specs) if argmax[i] != s), None)
            if si is not None:  # reject: the correction is forced into a cold start
                output = specs[:si] + [argmax[si]]
                kept += [pending] + specs[:si]
                forced, pending, specs = argmax[si], None, []
            else:
                sampled = argmax[len(specs) : len(specs) + n]
                output = specs + [sampled[0]]
                kept += [pending] + specs
                pending, specs = sampled[0], sampled[1:]
        else:
            sampled = argmax[:n]
            output = [sampled[0]] if forced is not None else [t0, sampled[0]]
            kept += [t0]
            pending, specs, forced = sampled[0], sampled[1:], None
        out += output
        at = next((i for i, t in enumerate(out) if t in eos_ids), None)
        if at is not None:
            return out[:at], forwards
        if len(out) >= max_new_tokens:
            return out[:max_new_tokens], forwards
