"""Caches and decoding loops beyond full recompute, one module per layout or family loop.

Importing this package registers them in engine.BACKENDS / engine.DECODERS. Each module
registers itself at import; list it here.
"""

import importlib

_MODULES = ("block_cache", "causal_prefix", "canvas")

for _name in _MODULES:
    importlib.import_module(f"{__name__}.{_name}")
