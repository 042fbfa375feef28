"""Start-up file of the suite's fresh interpreters (conftest puts this folder on PYTHONPATH): they
run without torch, as a user's install does (torch is only the tests' reference, never a
dependency). transformers imports torch whenever it can find it, about 2 s of every start here;
with `sys.modules["torch"] = None`, `importlib.util.find_spec("torch")` says it is absent, so
transformers and mlx-vlm take the paths they take without it."""

import sys

sys.modules.setdefault("torch", None)
