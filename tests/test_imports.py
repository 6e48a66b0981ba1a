"""flashjax's modules import one way (no cycle, function-level imports included) and
use no other module's private names. Read from the source with `ast`: nothing is
imported or compiled."""

import ast
import importlib.util
import pathlib

PACKAGE = pathlib.Path(importlib.util.find_spec("flashjax").origin).parent
# The benchmark CLI (bench.py dispatches to bench_varlen / bench_decode, which use its
# helpers) is left out until it becomes a subpackage.
MODULES = {p.stem: p for p in PACKAGE.glob("*.py") if not p.stem.startswith("bench")}


def _imports(module: str) -> list:
    """(imported module, names taken from it) of each flashjax import in `module`."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level == 1 or
                                                 (node.module or "").startswith("flashjax")):
            base = (node.module or "").removeprefix("flashjax").lstrip(".")
            if base:
                found.append((base, [a.name for a in node.names]))
            else:  # from . import a, b
                found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name.removeprefix("flashjax."), []) for a in node.names
                      if a.name.startswith("flashjax.")]
    return [(m or "__init__", names) for m, names in found if (m or "__init__") in MODULES]


def test_no_import_cycles():
    graph = {m: {imported for imported, _ in _imports(m)} for m in MODULES}
    done, path = set(), []

    def visit(module):
        assert module not in path, "import cycle: " + " -> ".join(path + [module])
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)
    for module in sorted(MODULES):
        visit(module)


def test_no_module_uses_another_modules_private_names():
    offences = []
    for module in MODULES:
        imports = _imports(module)
        aliases = {imported for imported, names in imports if not names}
        offences += [f"{module}: from {imported} import {name}" for imported, names in imports
                     for name in names if name.startswith("_")]
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                offences.append(f"{module}: {node.value.id}.{node.attr}")
    assert not offences, offences
