"""Lets mlx-lm find this package's model classes without patching mlx-lm.

mlx-lm resolves a checkpoint's `model_type` with `importlib.import_module(f"mlx_lm.models.{type}")`.
A finder on `sys.meta_path` answers those imports, for the model types in
`mlx_dllm_models.registry.MODEL_TYPES`, with our module (the same module object, so classes are
shared under both names). It is installed at interpreter start-up by `mlx_dllm_models.pth`, so it
must import nothing heavy: only the standard library, and mlx only once a model is really imported.

It also adjusts two mlx-lm modules once they are really imported (before any other module binds
their names), for this package's model types only:

* `mlx_lm.tuner.trainer` (imported by `mlx_lm.lora`): its `train` and `evaluate` refuse a
  masked-diffusion model with mlx-lm's default next-token loss, pointing to `mlx_dllm lora`
  (mlx_dllm_models.trainer_guard.guard_trainer); a caller's own loss, as `mlx_dllm lora` passes,
  goes through.
* `mlx_lm.utils` (mlx_dllm_models.conversion.guard_mlx_lm_utils): `load_tokenizer` says no to the
  checkpoint's remote code unless the caller opts in (transformers' AutoTokenizer would otherwise
  stop 15 s on "Do you wish to run the custom code? [y/N]" on a terminal, as the checkpoints of
  these families carry an `auto_map`), and `save` (what `python -m mlx_lm convert` writes with)
  leaves no `auto_map` / remote code in the output and writes this package's model card, as
  `mlx_dllm convert` does.
* `mlx_vlm.utils` (mlx_dllm_models.conversion.guard_mlx_vlm_utils): `load_processor` says no to
  the checkpoint's remote code in the same way (LaViDa's checkpoints carry an `auto_map`).
"""

import importlib
import importlib.abc
import importlib.util
import sys

_PREFIX = "mlx_lm.models."
# mlx-vlm resolves a checkpoint's model_type the same way, under its own package.
_VLM_PREFIX = "mlx_vlm.models."


def _model_types(prefix=_PREFIX):
    # registry.py is plain data; load it without importing the package's heavy parts.
    from mlx_dllm_models.registry import MODEL_TYPES, VLM_MODEL_TYPES

    return VLM_MODEL_TYPES if prefix == _VLM_PREFIX else MODEL_TYPES


class _Loader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # already executed under its own name


class DiffusionModelFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix = next((p for p in (_PREFIX, _VLM_PREFIX) if fullname.startswith(p)), None)
        if prefix is None:
            return None
        name = fullname[len(prefix) :]
        if "." in name:
            return None
        module = _model_types(prefix).get(name)
        if module is None:
            return None
        target_name = f"mlx_dllm_models.models.{module}"
        if importlib.util.find_spec(target_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(target_name))


# mlx-lm modules adjusted once executed: module -> (this package's module, its function that takes
# the executed module). The trainer is what `mlx_lm.lora` (both `python -m mlx_lm lora` and
# `python -m mlx_lm.lora`, which runs lora.py as __main__) imports its `train` and `evaluate` from;
# utils holds the `load_tokenizer` and `save` that `mlx_lm.load` and `mlx_lm convert` call.
_AFTER_IMPORT = {
    "mlx_lm.tuner.trainer": ("mlx_dllm_models.trainer_guard", "guard_trainer"),
    "mlx_lm.utils": ("mlx_dllm_models.conversion", "guard_mlx_lm_utils"),
    # mlx-vlm's load_processor (mlx_vlm.load, mlx_vlm.convert): no remote code asked for.
    "mlx_vlm.utils": ("mlx_dllm_models.conversion", "guard_mlx_vlm_utils"),
}


def _adjust(module):
    target, function = _AFTER_IMPORT[module.__name__]
    # Both import mlx and the family facts, nothing of the loader or the commands.
    if importlib.util.find_spec(target) is not None:
        getattr(importlib.import_module(target), function)(module)


class _AdjustingLoader(importlib.abc.Loader):
    """The module's own loader, then its _AFTER_IMPORT function on the executed module."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _adjust(module)

    def __getattr__(self, name):  # get_source, get_code, get_resource_reader, ...
        return getattr(self.loader, name)


class AfterImportFinder(importlib.abc.MetaPathFinder):
    """Answers only the imports of the _AFTER_IMPORT modules (it must come before the path finder
    that would otherwise answer them), with the spec the other finders give and an adjusting
    loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AdjustingLoader(spec.loader)
        return spec


def install():
    if not any(isinstance(f, DiffusionModelFinder) for f in sys.meta_path):
        sys.meta_path.append(DiffusionModelFinder())
    if not any(isinstance(f, AfterImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImportFinder())
        # Imported before the hook was (a process without the .pth that imports the loader after
        # mlx-lm): adjusted now. The functions leave an already adjusted module as it is.
        for name in _AFTER_IMPORT:
            if name in sys.modules:
                _adjust(sys.modules[name])


install()
