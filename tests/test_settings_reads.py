"""Every read of the resolved settings in the package names a field of ResolvedSettings (or one of
its methods), so a misspelt setting fails here rather than in a run.

The convention the scan relies on: the resolved settings are held in names `settings` and `s`, and
in attributes `.settings` (of a request, job, decoder, backend, step context) and `self.s`; the
caller's unresolved settings (a mapping) are named otherwise (`overrides`). A function that binds
`settings` or `s` to something else (a `**settings` of keyword arguments, a parameter annotated
as a dict, a dict built in place, a loop over the table's rows) is read as holding that instead.
`spec.settings` (the family's rows) is not the resolved settings.
"""

import ast
import dataclasses
from pathlib import Path

from mlx_dllm_models.settings_fields import ResolvedSettings
from mlx_dllm_models.settings_record import RECORD_NAMES

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_dllm_models"
NAMES = ("settings", "s")
KNOWN = {f.name for f in dataclasses.fields(ResolvedSettings)} | set(RECORD_NAMES)
MAPPING_TYPES = ("dict", "Dict", "Mapping", "Optional")


def _other_bindings(func) -> set:
    """The names of NAMES that `func` binds to something other than the resolved settings."""
    other = set()
    args = func.args
    if args.kwarg is not None and args.kwarg.arg in NAMES:
        other.add(args.kwarg.arg)
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        if a.arg in NAMES and a.annotation is not None:
            if ast.unparse(a.annotation).startswith(MAPPING_TYPES):
                other.add(a.arg)
    for node in ast.walk(func):
        if isinstance(node, (ast.For, ast.comprehension)):
            other |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)} & set(NAMES)
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Dict, ast.DictComp)):
            other |= {t.id for t in node.targets if isinstance(t, ast.Name)} & set(NAMES)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            called = ast.unparse(node.value.func)
            if called in ("dict", "chosen_settings"):
                other |= {t.id for t in node.targets if isinstance(t, ast.Name)} & set(NAMES)
    return other


def _holds_settings(node, other: set) -> bool:
    if isinstance(node, ast.Name):
        return node.id in NAMES and node.id not in other
    if isinstance(node, ast.Attribute):
        owner = ast.unparse(node.value)
        if node.attr == "settings":
            return not (owner == "spec" or owner.endswith(("spec", "diffusion_spec")))
        return node.attr == "s" and owner == "self"
    return False


def _functions(tree):
    """Every function with the nodes that belong to it (not to a function nested in it)."""
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            nested = set()
            for inner in ast.walk(func):
                if inner is not func and isinstance(
                    inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
                ):
                    nested |= set(map(id, ast.walk(inner)))
            yield func, [n for n in ast.walk(func) if id(n) not in nested]


def bad_reads(source: str, where: str = "<source>"):
    """`file:line: what` for each read of the resolved settings that names no field or method."""
    found = []
    for func, nodes in _functions(ast.parse(source)):
        other = set() if isinstance(func, ast.Lambda) else _other_bindings(func)
        for node in nodes:
            if isinstance(node, ast.Attribute) and _holds_settings(node.value, other):
                if node.attr not in KNOWN:
                    found.append(f"{where}:{node.lineno}: .{node.attr} is no setting")
            elif isinstance(node, ast.Subscript) and _holds_settings(node.value, other):
                found.append(f"{where}:{node.lineno}: item access {ast.unparse(node)}")
    return found


def test_every_read_of_the_resolved_settings_names_a_field():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += bad_reads(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    assert not found, "\n".join(found)


def test_the_scan_catches_a_misspelt_read_and_item_access():
    source = (
        "def run(request, settings):\n"
        "    s = request.settings\n"
        "    return s.temprature, settings['seed'], request.settings.get('seed'), s.max_tokens\n"
    )
    found = bad_reads(source)
    assert [f.split(": ", 1)[1] for f in found] == [
        ".temprature is no setting",
        "item access settings['seed']",
        ".get is no setting",
    ]


def test_mappings_named_otherwise_are_not_read_as_settings():
    source = (
        "def run(spec, overrides, **settings):\n"
        "    rows = [s.name for s in spec.settings]\n"
        "    return settings.get('seed'), overrides['seed'], rows\n"
        "def table(settings: dict):\n"
        "    return settings['seed']\n"
    )
    assert bad_reads(source) == []
