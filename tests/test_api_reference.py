"""The API reference (docs/api/*.md, rendered by mkdocstrings from the docstrings) documents the
whole public API: every public name of ``linattn``, ``linattn.nn``, ``linattn.hf`` and
``linattn.serve`` is on a page and has a docstring (without the project's internal shorthand),
every parameter of a public class's constructor or of a public function is described in its
docstring's ``Args:`` (or, for a dataclass, its field's own docstring), and every field of
``LMConfig`` and ``TrainConfig`` has a docstring. The docstrings are read with griffe, as
mkdocstrings reads them: no site build."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import griffe
import pytest

from _helpers import SHORTHAND

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("linattn", "linattn.nn", "linattn.hf", "linattn.serve")
# A class documented as taking every field of another: those parameters are described there.
FIELDS_OF = {"linattn.hf.config.LinattnConfig": "linattn.models.config.LMConfig"}
_SELF = {"self", "cls"}


@pytest.fixture(scope="module")
def package() -> griffe.Module:
    return griffe.load("linattn", search_paths=[str(ROOT / "src")], docstring_parser="google",
                       resolve_aliases=True, resolve_external=False)


def _public() -> list[tuple[str, str]]:
    """``(module, name)`` for every name in the ``__all__`` of ``MODULES`` (``__version__``, a
    string, is named on docs/api/index.md); ``(module, "__all__")`` for a module without one."""
    return [(module, name) for module in MODULES
            for name in getattr(importlib.import_module(module), "__all__", ["__all__"]) if name != "__version__"]


def _target(package: griffe.Module, path: str) -> griffe.Object:
    obj = package[path.removeprefix("linattn.")] if path != "linattn" else package
    return obj.final_target if obj.is_alias else obj


def _directives() -> dict[str, list[str] | None]:
    """``::: PATH`` on docs/api/*.md -> the members its ``options: members:`` lists (None: all)."""
    found = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for match in re.finditer(r"^::: (\S+)\n((?:[ \t]+.*\n?)*)", page.read_text(encoding="utf-8"), re.M):
            options = match.group(2)
            members = re.search(r"members:\s*\n((?:\s+- \S+\n?)+)", options)
            found[match.group(1)] = re.findall(r"- (\S+)", members.group(1)) if members else None
    return found


def _documented_paths(package: griffe.Module) -> set[str]:
    """The canonical paths of the objects the API pages render."""
    paths = set()
    for directive, members in _directives().items():
        obj = _target(package, directive)
        paths.add(obj.path)
        if obj.is_module:
            names = members if members is not None else [name for name in obj.members if obj.members[name].is_public]
            paths |= {_target(package, f"{directive}.{name}").path for name in names}
    return paths


def _described(docstring: griffe.Docstring | None) -> set[str]:
    """The names an ``Args:``, ``Keyword Args:`` or ``Attributes:`` section describes."""
    if docstring is None:
        return set()
    kinds = (griffe.DocstringSectionKind.parameters, griffe.DocstringSectionKind.other_parameters,
             griffe.DocstringSectionKind.attributes)
    return {item.name for section in docstring.parsed if section.kind in kinds for item in section.value
            if item.description.strip()}


def _declared_parameters(value: object) -> list[str]:
    """The parameters of a function, or of a class's constructor, that linattn declares: those a
    base class of another package declares (``PretrainedConfig``'s, ...) are documented there."""
    try:
        signature = inspect.signature(value)
    except ValueError:  # a builtin's constructor, as an exception class has
        return []
    parameters = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not inspect.isclass(value):
        return parameters
    ours = set()
    for cls in value.__mro__:
        if cls.__module__.startswith("linattn."):
            ours |= set(cls.__dict__.get("__annotations__", {}))
            init = cls.__dict__.get("__init__")
            if init is not None and str(ROOT / "src") in getattr(getattr(init, "__code__", None), "co_filename", ""):
                ours |= set(inspect.signature(init).parameters)
    return [name for name in parameters if name in ours]


def _undocumented_parameters(obj: griffe.Object, value: object) -> list[str]:
    """The parameters of ``value`` (``obj`` as griffe reads it) that no docstring describes."""
    parameters = _declared_parameters(value)
    described = _described(obj.docstring)
    if obj.is_class:
        init = obj.all_members.get("__init__")
        described |= _described(init.docstring if init is not None else None)
        described |= {name for name, member in obj.all_members.items() if member.is_attribute and member.docstring}
        if obj.path in FIELDS_OF:
            fields = _target(obj.package, FIELDS_OF[obj.path].removeprefix("linattn."))
            described |= {name for name, member in fields.members.items() if member.is_attribute and member.docstring}
    return [name for name in parameters if name not in described]


@pytest.mark.parametrize("module, name", [pytest.param(*entry, id=".".join(entry)) for entry in _public()])
def test_every_public_name_is_documented_on_an_api_page(package, module, name):
    assert name != "__all__", f"{module} has no __all__: its public names are undeclared"
    obj = _target(package, f"{module}.{name}")
    assert obj.path in _documented_paths(package), f"no '::: {module}.{name}' (or its module) on a docs/api page"
    assert obj.docstring is not None and obj.docstring.value.strip(), f"{module}.{name} has no docstring"
    assert not SHORTHAND.search(obj.docstring.value), f"{module}.{name}: internal shorthand in its docstring"
    value = getattr(importlib.import_module(module), name)
    if inspect.isclass(value) or inspect.isfunction(value):
        missing = _undocumented_parameters(obj, value)
        assert missing == [], f"{module}.{name}: parameters without a description in Args: {missing}"


@pytest.mark.parametrize("module, name", [("linattn.models.config", "LMConfig"),
                                          ("linattn.train.config", "TrainConfig")])
def test_every_config_field_has_its_docstring(package, module, name):
    """The fields of the run file's ``[model]`` and ``[train]`` tables: each rendered with its
    type, default and meaning (the field's own docstring)."""
    config = package[f"{module}.{name}".removeprefix("linattn.")]
    fields = [field.name for field in dataclasses.fields(getattr(importlib.import_module(module), name))]
    assert len(fields) > 30
    assert [field for field in fields if field not in config.members or not config.members[field].docstring] == []
    assert config.path in _documented_paths(package), f"no '::: {module}.{name}' on a docs/api page"
