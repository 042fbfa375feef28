"""Independent PyTorch transcription of BD3-LM's sampling-time forward and sampler
(kuleshov-group/bd3lms @ HEAD: models/hf/modeling_bd3lm.py, diffusion.py), for the parity tests.

Forward (`DITBackbone.forward(sample_mode=True)`, attn_backend "sdpa", eval mode, float32):
embedding, adaLN conditioning silu(sigma_map(0)) (time_conditioning false zeroes sigma), DDiT
blocks (LayerNorm without bias in float32, fused qkv, rotate-half rotary on q and k, SDPA with the
x0 half of block_diff_mask: block_q >= block_kv, blocks from position 0), the modulated final
layer. flex attention is replaced by the explicit mask, as upstream's "sdpa" backend does.

KV cache (`reset_kv_cache`, `DDiTBlock.get_qkv`): each layer keeps the *unrotated* qkv of the
finished blocks; a forward over one block writes its qkv after them, rotates the whole cache at
positions 0.. and attends with no mask; `store_kv` advances the cursor. Upstream's cache is
bfloat16 (`cache_dtype`; float32 here by default, which is what the float32 path without cache
computes). The sliding window past model_length is not transcribed.

Sampler (`_semi_ar_sampler` with first_hitting, `_ddpm_caching_update`, `_nucleus_sample`,
`_subs_parameterization`, `_sample_categorical`): per block, per step: p_x0 of the block in float64
(mask logit -1e6 before the log-softmax, committed positions one-hot), the nucleus (sorted
cumulative probability <= p, the first kept, renormalised), a categorical draw of every position
(probs / (1e-10 - log(u + 1e-10)), argmax), one uniformly chosen masked position takes its draw;
a finished block is forwarded once with store_kv. Upstream starts from [BOS, masks] and draws the
position with torch.randint; here the prompt may be longer than the BOS (its whole blocks are
forwarded with store_kv first) and both draws come from the caller (`draw_tokens(shape)` -> uniform
(B, block, V); `draw_position(masked)` -> (B,) index), so that a test can replay the engine's
draws. The stop conditions (_check_stop_conds: entropy < 4 rejection, var_length's second EOS)
are not transcribed.
"""

import math

import torch
import torch.nn.functional as F

# Tiny matmuls: one thread beats two that contend with MLX and the other tests on two cores.
torch.set_num_threads(1)


class BD3LMReference:
    def __init__(self, state: dict, cfg: dict):
        self.w = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in state.items()}
        self.cfg = cfg
        self.bs = cfg["block_size"]
        self.heads = cfg["n_heads"]
        self.dim = cfg["hidden_dim"]
        self.layers = cfg["n_blocks"]
        self.mask_index = cfg["vocab_size"] - 1
        self.kv = None

    # ------------------------------------------------------------------ layers

    def _lin(self, x, name, bias=True):
        b = self.w.get(name + ".bias") if bias else None
        return F.linear(x, self.w[name + ".weight"], b)

    def _ln(self, x, name):
        return F.layer_norm(x.float(), [self.dim]) * self.w[name + ".weight"][None, None]

    def _cond(self):
        half = 128
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = torch.zeros(1)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        h = self._lin(emb, "backbone.sigma_map.mlp.0")
        h = self._lin(F.silu(h), "backbone.sigma_map.mlp.2")
        return F.silu(h)

    def _rotary(self, length):
        hd = self.dim // self.heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.einsum("i,j->ij", torch.arange(length).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
        sin = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
        cos[:, :, 2] = 1.0  # v is not rotated
        sin[:, :, 2] = 0.0
        return cos, sin

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def _block(self, i, x, c, mask, store_kv):
        p = f"backbone.blocks.{i}."
        mods = self._lin(c, p + "adaLN_modulation")[:, None].chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        x_skip = x
        h = self._ln(x, p + "norm1") * (1 + scale_msa) + shift_msa
        qkv = self._lin(h, p + "attn_qkv", bias=False)
        if self.kv is not None:
            cache, idx = self.kv[i]
            n = qkv.shape[1]
            cache[:, idx : idx + n] = qkv.to(cache.dtype)
            qkv = cache[:, : idx + n].clone().float()
            if store_kv:
                self.kv[i] = (cache, idx + n)
        B, S, _ = qkv.shape
        qkv = qkv.view(B, S, 3, self.heads, -1)
        cos, sin = self._rotary(S)
        qkv = qkv * cos + self._rotate_half(qkv) * sin
        qkv = qkv.transpose(1, 3)  # b h three s d
        hd = qkv.shape[-1]
        att = F.scaled_dot_product_attention(
            qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], attn_mask=mask, scale=1 / math.sqrt(hd)
        )
        att = att.transpose(1, 2).reshape(B, S, -1)
        if self.kv is not None:
            att = att[:, -x.shape[1] :]
        x = x_skip + gate_msa * self._lin(att, p + "attn_out", bias=False)
        h = self._ln(x, p + "norm2") * (1 + scale_mlp) + shift_mlp
        h = self._lin(F.gelu(self._lin(h, p + "mlp.0"), approximate="tanh"), p + "mlp.2")
        return x + gate_mlp * h

    # ----------------------------------------------------------------- forward

    def block_causal_mask(self, length):
        q = torch.arange(length)[:, None] // self.bs
        k = torch.arange(length)[None, :] // self.bs
        return q >= k

    @torch.no_grad()
    def forward(self, ids, store_kv=False):
        """Logits (B, L, V), float32. Without a cache: the whole sequence under the x0 half of
        block_diff_mask; with one (reset_kv_cache): `ids` is one block after the cached ones."""
        x = self.w["backbone.vocab_embed.embedding"][torch.as_tensor(ids)]
        c = self._cond()
        mask = None if self.kv is not None else self.block_causal_mask(x.shape[1])
        for i in range(self.layers):
            x = self._block(i, x, c, mask, store_kv)
        o = "backbone.output_layer."
        shift, scale = self._lin(c, o + "adaLN_modulation")[:, None].chunk(2, dim=2)
        x = self._ln(x, o + "norm_final") * (1 + scale) + shift
        return self._lin(x, o + "linear")

    def reset_kv_cache(self, batch, cache_dtype=torch.float32):
        length = self.cfg["model_length"]
        self.kv = [
            (torch.zeros(batch, length, 3 * self.dim, dtype=cache_dtype), 0)
            for _ in range(self.layers)
        ]

    # ----------------------------------------------------------------- sampler

    def p_x0(self, logits, x_block):
        """_subs_parameterization, then exp, in float64."""
        logits = logits.to(torch.float64)
        logits[:, :, self.mask_index] += -1000000.0
        logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        unmasked = x_block != self.mask_index
        logits[unmasked] = -1000000.0
        logits[unmasked, x_block[unmasked]] = 0
        return logits.exp()

    @staticmethod
    def nucleus(p_x0, p):
        if p == 1.0:
            return p_x0
        sorted_probs, sorted_indices = p_x0.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) <= p
        keep[..., 0] = 1
        out = torch.zeros_like(p_x0).scatter_(-1, sorted_indices, sorted_probs * keep)
        return out / out.sum(-1, keepdim=True)

    @torch.no_grad()
    def sample(self, prompt, max_tokens, nucleus_p, draw_tokens, draw_position, kv_cache=True):
        """_semi_ar_sampler (first_hitting) for one batch of equal-length prompts (B, n): the
        (B, n + max_tokens rounded up to whole blocks) tokens and the NFE."""
        x = torch.as_tensor(prompt, dtype=torch.long)
        B, n = x.shape
        total = -(-(n + max_tokens) // self.bs) * self.bs
        x = torch.cat([x, torch.full((B, total - n), self.mask_index)], dim=1)
        first = n // self.bs
        nfe = 0
        if kv_cache:
            self.reset_kv_cache(B)
            for b in range(first):  # the prompt's whole blocks
                self.forward(x[:, b * self.bs : (b + 1) * self.bs], store_kv=True)
        for b in range(first, total // self.bs):
            lo, hi = b * self.bs, (b + 1) * self.bs
            while (x[:, lo:hi] == self.mask_index).any():
                block = x[:, lo:hi]
                logits = self.forward(block) if kv_cache else self.forward(x[:, :hi])[:, lo:]
                nfe += 1
                p = self.nucleus(self.p_x0(logits, block), nucleus_p)
                u = torch.as_tensor(draw_tokens(p.shape), dtype=torch.float64)
                sampled = (p / (1e-10 - (u + 1e-10).log())).argmax(dim=-1)
                masked = block == self.mask_index
                ind = torch.as_tensor(draw_position(masked))
                pick = torch.arange(self.bs)[None] == ind[:, None]
                new = torch.where(pick & masked, sampled, block)
                x[:, lo:hi] = new
            if kv_cache:
                self.forward(x[:, lo:hi], store_kv=True)
        self.kv = None
        return x, nfe
