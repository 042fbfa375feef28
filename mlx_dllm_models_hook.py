"""Lets mlx-lm find this package's model classes without patching mlx-lm.

mlx-lm resolves a checkpoint's `model_type` with `importlib.import_module(f"mlx_lm.models.{type}")`.
A finder on `sys.meta_path` answers those imports, for the model types in
`mlx_dllm_models.registry.MODEL_TYPES`, with our module (the same module object, so classes are
shared under both names). It is installed at interpreter start-up by `mlx_dllm_models.pth`, so it
must import nothing heavy: only the standard library, and mlx only once a model is really imported.

It also guards mlx-lm's trainer: once `mlx_lm.tuner.trainer` is really imported (by `mlx_lm.lora`),
its `train` and `evaluate` refuse a masked-diffusion model with mlx-lm's default next-token loss,
pointing to `mlx_dllm lora` (mlx_dllm_models.trainer_guard.guard_trainer); a caller's own loss,
as `mlx_dllm lora` passes, goes through.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_PREFIX = "mlx_lm.models."


def _model_types():
    # registry.py is plain data; load it without importing the package's heavy parts.
    from mlx_dllm_models.registry import MODEL_TYPES

    return MODEL_TYPES


class _Loader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # already executed under its own name


class DiffusionModelFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_PREFIX):
            return None
        name = fullname[len(_PREFIX) :]
        if "." in name:
            return None
        module = _model_types().get(name)
        if module is None:
            return None
        target_name = f"mlx_dllm_models.models.{module}"
        if importlib.util.find_spec(target_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(target_name))


# mlx-lm's trainer, which `mlx_lm.lora` (both `python -m mlx_lm lora` and `python -m mlx_lm.lora`,
# which runs lora.py as __main__) imports its `train` and `evaluate` from.
_TRAINER = "mlx_lm.tuner.trainer"


class _GuardedTrainerLoader(importlib.abc.Loader):
    """The trainer's own loader, then mlx_dllm_models.trainer_guard.guard_trainer on the executed
    module: its `train` / `evaluate` refuse a diffusion model with mlx-lm's next-token loss."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        # trainer_guard imports mlx and the family facts, nothing of the loader or the commands.
        if importlib.util.find_spec("mlx_dllm_models.trainer_guard") is not None:
            importlib.import_module("mlx_dllm_models.trainer_guard").guard_trainer(module)

    def __getattr__(self, name):  # get_source, get_code, get_resource_reader, ...
        return getattr(self.loader, name)


class TrainerGuardFinder(importlib.abc.MetaPathFinder):
    """Answers only the import of mlx-lm's trainer (it must come before the path finder that would
    otherwise answer it), with the spec the other finders give and a guarding loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRAINER:
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
            spec.loader = _GuardedTrainerLoader(spec.loader)
        return spec


def install():
    if not any(isinstance(f, DiffusionModelFinder) for f in sys.meta_path):
        sys.meta_path.append(DiffusionModelFinder())
    if not any(isinstance(f, TrainerGuardFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TrainerGuardFinder())


install()
