"""The layout of ``ops/`` holds (docs/design.md, "Layers of the package"): one package per
mechanism family, dependencies pointing one way, no circle between modules (imports inside
functions included), and no source file of src/ or tools/ (C++ included) over 600 lines.

The rules are checked on the import statements of every module's syntax tree
(``_imports``), so each is also run on small made-up trees that break it: a checker that
cannot see a violation would pass the real tree trivially.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "linattn"
FAMILIES = ("softmax", "kernel", "delta", "vq", "sparse")
SHARED = "common"
# what an ops module may import from the rest of linattn: the checks and the state dataclasses
BELOW_OPS = ("linattn._checks", "linattn.state")
MOST_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ops_sources() -> dict[str, str]:
    """``{module name: source}`` of every module under ``src/linattn/ops``."""
    return {_module_name(path): path.read_text() for path in sorted((PACKAGE / "ops").rglob("*.py"))}


def _imports(name: str, source: str, is_package: bool) -> list[tuple[str, str | None]]:
    """Every import of a module, at any depth of its body, as ``(module, imported name or None)``
    with relative imports resolved against ``name``."""
    found = []
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = ".".join(part for part in (base if node.level else "", node.module or "") if part)
            found += [(module, alias.name) for alias in node.names]
    return found


def _family(module: str) -> str | None:
    """``"vq"`` for ``linattn.ops.vq.block``; None for ``linattn.ops`` itself and outside ops."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["linattn", "ops"] else None


def _violations(sources: dict[str, str], packages: set[str]) -> list[str]:
    """Every import of ``sources`` (ops modules) that breaks a layering rule, as a sentence."""
    found = []
    for name, source in sources.items():
        family = _family(name)
        for module, imported in _imports(name, source, name in packages):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in sources else module
            if not target.startswith("linattn."):
                continue  # torch, triton, the standard library
            if not target.startswith("linattn.ops"):
                if not target.startswith(BELOW_OPS):
                    found.append(f"{name} imports {target}: ops may import only {', '.join(BELOW_OPS)}")
                continue
            other = _family(target)
            leaf = target.rpartition(".")[2]
            if imported and imported.startswith("_") and target == module:
                found.append(f"{name} imports the private name {imported} from {module}")
            if leaf.startswith("_") and target != name:
                found.append(f"{name} imports the private module {target}")
            if other is None or other == family:
                continue
            if family == SHARED:
                found.append(f"{name} (shared helpers) imports the family module {target}")
            elif other != SHARED and target != f"linattn.ops.{other}":
                found.append(f"{name} imports {target}: another family is imported through its package "
                             f"linattn.ops.{other} only")
    return found


def _circles(sources: dict[str, str], packages: set[str]) -> list[list[str]]:
    """The import circles among ``sources`` (each found once, as the path that closes it)."""
    graph = {}
    for name, source in sources.items():
        edges = set()
        for module, imported in _imports(name, source, name in packages):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in sources else module
            if target in sources and target != name and not name.startswith(target + "."):
                edges.add(target)  # a submodule's import of its own package's __init__ is not a circle
        graph[name] = sorted(edges)
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [node])
    return circles


def _packages(sources: dict[str, str]) -> set[str]:
    return {name for name in sources if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}


def test_ops_is_one_package_per_family_with_shared_helpers_apart():
    packages = {path.name for path in (PACKAGE / "ops").iterdir() if (path / "__init__.py").exists()}
    assert packages == {*FAMILIES, SHARED}
    assert [path.name for path in (PACKAGE / "ops").glob("*.py")] == ["__init__.py"]


def test_ops_imports_follow_the_layering_rules():
    sources = _ops_sources()
    assert _violations(sources, _packages(sources)) == []


def test_no_circle_between_ops_modules():
    sources = _ops_sources()
    assert _circles(sources, _packages(sources)) == []


_BAD_TREES = {
    "an op importing a layer": ({"linattn.ops.kernel.forms": "from ...nn.attention import Attention\n"},
                                "ops may import only"),
    "a private name of a sibling": ({"linattn.ops.vq.step": "from .attention import _result\n",
                                     "linattn.ops.vq.attention": ""}, "private name _result"),
    "a private module": ({"linattn.ops.vq.step": "from . import _hidden\n", "linattn.ops.vq._hidden": ""},
                         "private module"),
    "another family's module": ({"linattn.ops.delta.rule": "from ..kernel.forms import Features\n",
                                 "linattn.ops.kernel.forms": ""}, "through its package"),
    "shared helpers importing a family": ({"linattn.ops.common.bias": "from ..vq import vq_attention\n"},
                                          "shared helpers"),
    "a lazy import of a private name": ({"linattn.ops.vq.fused": "def f():\n    from .block import _cut\n",
                                         "linattn.ops.vq.block": ""}, "private name _cut"),
}


@pytest.mark.parametrize("case", sorted(_BAD_TREES))
def test_each_rule_catches_its_violation(case):
    sources, message = _BAD_TREES[case]
    assert any(message in line for line in _violations(sources, set())), case


def test_a_circle_through_a_function_level_import_is_found():
    sources = {"linattn.ops.vq.a": "from .b import f\n", "linattn.ops.vq.b": "def g():\n    from .c import h\n",
               "linattn.ops.vq.c": "import linattn.ops.vq.a\n", "linattn.ops.vq.d": "from .a import f\n"}
    assert _circles(sources, set()) == [["linattn.ops.vq.a", "linattn.ops.vq.b", "linattn.ops.vq.c",
                                         "linattn.ops.vq.a"]]
    del sources["linattn.ops.vq.c"]
    assert _circles(sources, set()) == []


def test_no_source_file_over_600_lines():
    """Split by responsibility when a module grows past this (docs/design.md); the native
    kernels' C++ sources and headers too."""
    native = [*PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")]
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tools").rglob("*.py"), *native]
    assert len(files) > 100 and len(native) > 20
    long = {str(path.relative_to(ROOT)): n for path in files if (n := len(path.read_text().splitlines())) > MOST_LINES}
    assert long == {}
