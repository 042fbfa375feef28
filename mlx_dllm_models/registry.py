"""The Hugging Face model types this package provides, and the mlx-lm module name each resolves to.

Kept free of heavy imports: the import hook reads it at interpreter start-up.
"""

# Hugging Face `model_type` -> module under mlx_dllm_models.models. mlx-lm imports
# `mlx_lm.models.<model_type>`; the hook answers that import with our module.
MODEL_TYPES = {
    "llada": "llada",
    # dllm's instructions rewrite LLaDA-MoE's model_type to "lladamoe"; same module.
    "lladamoe": "llada",
    "Dream": "dream",
    "dream": "dream",
    "sdar": "sdar",
    "sdar_moe": "sdar_moe",
    "llada2_moe": "llada2_moe",
    # NVIDIA's Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_*) writes "Fast_dLLM_Qwen".
    "Fast_dLLM_Qwen": "fast_dllm_qwen",
    "fast_dllm_qwen": "fast_dllm_qwen",
    "nemotron_labs_diffusion": "nemotron_labs_diffusion",
    "diffusion_gemma": "diffusion_gemma",
    # Radical Numerics' RND1 (Qwen3-30B-A3B read bidirectionally).
    "rnd1": "rnd1",
    # Salesforce's CoDA writes "CoDA" (mlx-lm imports the model_type as given); same module.
    "CoDA": "coda",
    "coda": "coda",
    # Tencent's WeDLM (a Qwen2.5 / Qwen3 body, model_type "wedlm"; plain Qwen checkpoints write
    # qwen2 / qwen3 and stay mlx-lm's).
    "wedlm": "wedlm",
    # dllm's A2D conversions (ZHZisZZ/dllm: Qwen3 / Qwen2.5 without the causal mask, MDLM- or
    # BD3LM-trained; the sampler says which).
    "a2d-qwen3": "a2d_qwen3",
    "a2d-qwen2": "a2d_qwen2",
    # Open-dLLM's Open-dCoder (a Qwen2.5-Coder body trained as masked diffusion): the checkpoint
    # writes "qwen2", which stays mlx-lm's; `mlx_dllm convert --model-type open_dcoder` writes this.
    "open_dcoder": "open_dcoder",
    # GSAI-ML's LLaDA-V (LLaDA 8B with a SigLIP tower, LLaVA-OneVision style).
    "llava_llada": "llava_llada",
    # NVIDIA's Nemotron-Labs-Diffusion-VLM (the Nemotron-Labs-Diffusion body, a Pixtral tower).
    "nemotron_labs_diffusion_vlm": "nemotron_labs_diffusion_vlm",
    # rp-yu's Dimple-7B (Dream 7B with Qwen2.5-VL's vision encoder).
    "dimple": "dimple",
    # LaViDa-Dream (Dream 7B with LaViDa's SigLIP path; LaViDa-LLaDA is a llava_llada).
    "llava_dream": "llava_dream",
    # SDAR-VL (SDAR's body with LLaVA-OneVision's SigLIP path).
    "sdar_v": "sdar_v",
    # kuleshov-group's BD3-LM (bd3lm-owt-block_size4 / 8 / 16: a 110M DiT over GPT-2's tokenizer).
    "bd3lm": "bd3lm",
    # Gen-Verse's MMaDA-8B (LLaDA 8B's body; text-to-image through MAGVIT-v2 tokens, images.py).
    "mmada": "mmada",
    # ByteDance Seed's Stable-DiffCoder (Seed-Coder's Llama body, block diffusion): the checkpoint
    # writes "llama", which stays mlx-lm's; `mlx_dllm convert --model-type stable_diffcoder`
    # writes this.
    "stable_diffcoder": "stable_diffcoder",
    # Zigeng's DMax (LLaDA2.0-mini fine-tunes for soft parallel decoding): the checkpoint writes
    # "llada2_moe" (LLaDA2's decoding); `mlx_dllm convert --model-type dmax` writes this.
    "dmax": "dmax",
    # dvruette's GIDD (gidd-unif-3b, gidd-mask-3b, gidd-unif-10b: uniform or masked noise).
    "gidd": "gidd",
    # I-DLM (Qwen3 converted to introspective diffusion, SDAR's layout): the checkpoint writes
    # "sdar" (SDAR's block diffusion); `mlx_dllm convert --model-type idlm` writes this.
    "idlm": "idlm",
}

# Families whose checkpoints are saved under another family's model_type: their autoregressive
# body's, which this package never takes over from mlx-lm (a plain qwen2 is an AR model), or the
# family they were fine-tuned from, which decodes otherwise (DMax's llada2_moe): the model_type that
# `mlx_dllm convert --model-type` writes instead -> the source model_types it accepts.
RETYPES = {
    "open_dcoder": ("qwen2",),
    "stable_diffcoder": ("llama",),
    "dmax": ("llada2_moe",),
    "idlm": ("sdar",),
}

# Model types that mlx-vlm's `mlx_vlm.models.<model_type>` resolves to our module as well (the
# vision families that mlx-vlm does not ship; mlx_vlm.load / convert then handle them).
VLM_MODEL_TYPES = {
    "llava_llada": "llava_llada",
    "nemotron_labs_diffusion_vlm": "nemotron_labs_diffusion_vlm",
    "dimple": "dimple",
    "llava_dream": "llava_dream",
    "sdar_v": "sdar_v",
}
