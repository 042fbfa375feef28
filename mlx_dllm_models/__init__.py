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


def lazy_exports(namespace: dict, exports: dict):
    """A module's `__getattr__` that imports each name of `exports` (name -> module path) on its
    first use and keeps it in `namespace` (the module's globals)."""

    def __getattr__(name):
        if name in exports:
            import importlib

            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value  # resolved once
            return value
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_exports(globals(), _EXPORTS)
