"""Lets mlx-lm find this package's model classes without patching mlx-lm.

mlx-lm resolves a checkpoint's `model_type` with `importlib.import_module(f"mlx_lm.models.{type}")`.
A finder on `sys.meta_path` answers those imports, for the model types in
`mlx_dllm_models.registry.MODEL_TYPES`, with our module (the same module object, so classes are
shared under both names). It is installed at interpreter start-up by `mlx_dllm_models.pth`, so it
must import nothing heavy: only the standard library, and mlx only once a model is really imported.
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


def install():
    if not any(isinstance(f, DiffusionModelFinder) for f in sys.meta_path):
        sys.meta_path.append(DiffusionModelFinder())


install()
