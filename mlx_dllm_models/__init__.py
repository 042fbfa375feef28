"""Diffusion language models on MLX: model classes registered into mlx-lm, and a decoding engine.

Importing this package is cheap: the public names are resolved on first use.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "load": "mlx_dllm_models.loader",
    "generate_diffusion": "mlx_dllm_models.generate",
    "stream_generate_diffusion": "mlx_dllm_models.generate",
    "batch_generate_diffusion": "mlx_dllm_models.generate",
    "DiffusionResponse": "mlx_dllm_models.generate",
    "BatchResponse": "mlx_dllm_models.generate",
    "generate_image": "mlx_dllm_models.images",
    "stream_generate_image": "mlx_dllm_models.images",
    "batch_generate_image": "mlx_dllm_models.images",
    "ImageResponse": "mlx_dllm_models.images",
    "CheckpointError": "mlx_dllm_models.loader",
    "SettingsError": "mlx_dllm_models.settings",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'mlx_dllm_models' has no attribute {name!r}")
