"""Fast-dLLM v2, transcribed into plain PyTorch from its public remote code: the Hugging Face
repository Efficient-Large-Model/Fast_dLLM_v2_7B (same file in Fast_dLLM_v2_1.5B), `modeling.py`:

* `Fast_dLLM_QwenModel.forward` in eval mode: absolute positions `cache_position = arange(past,
  past + L)`, the mask `eval_block_diff_mask` (`q // block_size >= kv // block_size` over the
  queries' absolute positions and every cached key), no mask once a sub-block cache holds K/V;
* `Fast_dLLM_QwenAttention.forward`: q/k/v with bias, RoPE (rotate_half), the past K/V either
  stored (`update_past_key_values=True`) or only read (concatenated), SDPA with `is_causal=False`;
  with the sub-block cache (`use_block_cache=True`: `block_past_key_values` holds the K/V of the
  block window's last full forward; a forward over a sub-block writes its K/V over theirs at
  `replace_position` and attends, without a mask, to the prefix and that whole window);
* `Fast_dLLM_QwenForCausalLM.generate` (batch of one row): the prompt's whole blocks prefilled,
  the next token by argmax once a block is whole, sub-blocks of `small_block_size` each decoded
  until no mask is left, a step committing every mask of the sub-block with `x1_p > threshold`
  and the argmax in any case, logits shifted by `cat([logits[:, :1], logits[:, :-1]])`, the
  `stop_token` checks, and the final cut after the first stop token; with `use_block_cache`, a
  sub-block's step runs the whole window (and keeps its K/V) when it is the block's first or the
  sub-block's first position is still a mask, else the sub-block alone against the kept K/V;
* `sample_with_top_p` at temperature 0: `softmax(logits)`, its argmax.

The layers (RMSNorm in float32, SwiGLU MLP) are Qwen2's, as that file defines them. Copied from
the file as read through a mirror of the checkpoint's directory (GitHub Satgoy152/DualDiffusion,
FastDLLM_inferencing/Fast_dLLM_v2_7B/modeling.py; that copy adds a step counter and a logits hook
to generate, left out here, and drops the `block_past_key_values = None` at each block's start that
another mirror's "Vanilla generate of Fast-dLLM" has) and NVlabs/Fast-dLLM
v2/generation_functions.py (`batch_sample`, the same decoding over a batch, which resets the
sub-block cache at each block too).
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class Reference:
    def __init__(self, path):
        path = Path(path)
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = {
            k: v.to(torch.float32) for k, v in load_file(str(path / "model.safetensors")).items()
        }
        c = self.cfg
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c["hidden_size"] // self.heads
        self.eps = c["rms_norm_eps"]
        d = self.head_dim
        self.inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        if c.get("tie_word_embeddings"):
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]

    def _norm(self, x, weight):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.eps))

    def _rope(self, positions):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def _attention(self, i, h, cos, sin, mask, past, update, block=None, replace=None):
        p = f"model.layers.{i}.self_attn."
        B, L, _ = h.shape
        q = F.linear(h, self.w[p + "q_proj.weight"], self.w[p + "q_proj.bias"])
        k = F.linear(h, self.w[p + "k_proj.weight"], self.w[p + "k_proj.bias"])
        v = F.linear(h, self.w[p + "v_proj.weight"], self.w[p + "v_proj.bias"])
        q = q.view(B, L, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, L, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, L, -1, self.head_dim).transpose(1, 2)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        if block is not None:  # the sub-block cache: store the window, or write into it
            if len(block) <= i:
                block.append((k, v))
            else:
                block[i][0][:, :, replace : replace + L] = k
                block[i][1][:, :, replace : replace + L] = v
                k, v = block[i]
        if past is not None:
            if update:  # DynamicCache.update: store, then attend to everything stored
                if len(past) <= i:
                    past.append((k, v))
                else:
                    past[i] = (torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2))
                k, v = past[i]
            elif len(past) > i:  # read the prefix, keep nothing
                k = torch.cat((past[i][0], k), dim=-2)
                v = torch.cat((past[i][1], v), dim=-2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, is_causal=False
        )
        out = out.transpose(1, 2).reshape(B, L, -1)
        return F.linear(out, self.w[p + "o_proj.weight"])

    def forward(self, input_ids, past=None, update=False, block_size=32, block=None, replace=None):
        """Logits (B, L, V). `past`: a list of per-layer (K, V) (None: no cache); `update`: store
        this forward's K/V in it. `block`: the sub-block cache (a list, empty for a full window
        forward that fills it); `replace`: the column in the window where this forward's tokens
        sit once it holds K/V."""
        cached = past[0][0].shape[2] if past else 0
        L = input_ids.shape[1]
        first = cached + (replace or 0) if block is not None else cached
        positions = torch.arange(first, first + L)
        q_idx, kv_idx = positions[:, None], torch.arange(cached + L)[None, :]
        mask = (q_idx // block_size) >= (kv_idx // block_size)
        if block:  # a forward into a filled sub-block cache attends to everything, unmasked
            mask = None
        cos, sin = self._rope(positions)
        h = self.w["model.embed_tokens.weight"][input_ids]
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self._norm(h, self.w[p + "input_layernorm.weight"])
            a = self._attention(i, x, cos, sin, mask, past, update, block, replace)
            h = h + a
            x = self._norm(h, self.w[p + "post_attention_layernorm.weight"])
            gate = F.linear(x, self.w[p + "mlp.gate_proj.weight"])
            up = F.linear(x, self.w[p + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, self.w[p + "mlp.down_proj.weight"])
        h = self._norm(h, self.w["model.norm.weight"])
        return F.linear(h, self.w["lm_head.weight"])


def _stopped(x_t, prompt_length, stop_token, mask_id):
    """generate's check: a stop token after prompt_length with no mask before the first one."""
    gen = x_t[0, prompt_length:]
    hits = (gen == stop_token).nonzero()
    if len(hits) == 0:
        return False
    return int((gen[: int(hits[0][0])] == mask_id).sum()) == 0


@torch.no_grad()
def generate(
    ref,
    input_ids,
    max_new_tokens,
    mask_id,
    threshold=1,
    small_block_size=8,
    block_size=32,
    stop_token=None,
    use_block_cache=False,
):
    """Fast_dLLM_QwenForCausalLM.generate at temperature 0. Returns (the ids, prompt included,
    cut after the first stop token; the forward count)."""
    nfe = 0
    num_blocks = max_new_tokens // block_size
    original_input_length = input_ids.shape[1]
    past = None
    if input_ids.shape[1] > block_size:
        past = []
        logits = ref.forward(
            input_ids[:, : (input_ids.shape[1] // block_size * block_size)], past, True, block_size
        )
        nfe += 1
        if input_ids.shape[1] % block_size == 0:
            next_token = logits[:, -1:, :].argmax(dim=-1)
            input_ids = torch.cat([input_ids, next_token], dim=1)
    num_small_blocks = block_size // small_block_size
    for _ in range(num_blocks):
        if stop_token in input_ids[:, original_input_length:]:
            break
        prompt_length = input_ids.shape[1]
        x_init = mask_id * torch.ones(
            (1, block_size - prompt_length % block_size), dtype=torch.long
        )
        x_t = torch.cat([input_ids, x_init], dim=1)
        block_past = None
        while True:
            if _stopped(x_t, prompt_length, stop_token, mask_id):
                break
            mask_idx = x_t[:, -block_size:] == mask_id
            if mask_idx.sum() == 0:
                if past is None:
                    past = []
                logits = ref.forward(x_t[:, -block_size:], past, True, block_size)
                nfe += 1
                next_token = logits[:, -1:, :].argmax(dim=-1)
                x_t = torch.cat([x_t, next_token], dim=1)
                break
            for small_block_idx in range(num_small_blocks):
                small_block_start_idx = small_block_idx * small_block_size
                small_block_end_idx = small_block_start_idx + small_block_size
                start = -block_size + small_block_start_idx
                end = (
                    None if block_size == small_block_end_idx else -block_size + small_block_end_idx
                )
                while True:
                    mask_idx = x_t[:, -block_size:] == mask_id
                    if mask_idx[:, start:end].sum() == 0:
                        break
                    if _stopped(x_t, prompt_length, stop_token, mask_id):
                        break
                    nfe += 1
                    if use_block_cache and (
                        block_past is None
                        or (x_t[:, -block_size + small_block_start_idx] == mask_id).any()
                    ):
                        block_past = []
                        logits = ref.forward(
                            x_t[:, -block_size:], past, False, block_size, block=block_past
                        )
                        logits = torch.cat([logits[:, :1, :], logits[:, :-1, :]], dim=1)
                        logits = logits[:, start:end]
                    elif use_block_cache:
                        logits = ref.forward(
                            x_t[:, start:end],
                            past,
                            False,
                            block_size,
                            block=block_past,
                            replace=small_block_start_idx,
                        )
                        logits = torch.cat([logits[:, :1, :], logits[:, :-1, :]], dim=1)
                    else:
                        logits = ref.forward(x_t[:, -block_size:], past, False, block_size)
                        logits = torch.cat([logits[:, :1, :], logits[:, :-1, :]], dim=1)
                        logits = logits[:, start:end]
                    p_1t = torch.softmax(logits, dim=-1)  # sample_with_top_p, temperature 0
                    x_1 = p_1t.argmax(dim=-1)
                    x1_p = torch.squeeze(torch.gather(p_1t, dim=-1, index=x_1[..., None]), -1)
                    x1_p = torch.where(mask_idx[:, start:end], x1_p, -torch.inf)
                    unmask_idx = x1_p > threshold
                    max_prob_idx = x1_p.argmax(dim=-1)
                    unmask_idx[torch.arange(x_1.shape[0]), max_prob_idx] = True
                    unmask_idx = unmask_idx & mask_idx[:, start:end]
                    x_t[:, start:end][unmask_idx] = x_1[unmask_idx]
        input_ids = x_t
    if stop_token in input_ids[:, original_input_length:]:
        stop_token_idx = (input_ids[:, original_input_length:] == stop_token).nonzero()[0][1]
        input_ids = input_ids[:, : stop_token_idx + original_input_length + 1]
    return input_ids, nfe
