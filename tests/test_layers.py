"""The package's shape holds: each layer of ``agl`` imports only its own and lower layers, with no import
circles (docs/architecture.md). Imports inside functions count; ``if TYPE_CHECKING:`` imports do not."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "agl"
INTEGRATIONS = ROOT / "integrations"

# Lowest first. A module belongs to the first layer one of whose prefixes it equals or starts with.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("foundation", ("agl.types", "agl.errors", "agl.semconv", "agl.checks", "agl._util")),
    ("tracing", ("agl.tracing",)),
    ("openai_wire", ("agl.openai_wire",)),
    ("instrumentation", ("agl.instrumentation",)),
    ("integrations", ("agl.integrations",)),
    ("store", ("agl.store",)),
    ("lightningrl", ("agl.lightningrl",)),
    ("serving", ("agl.serving", "agl.testing")),
    ("ui", ("agl.ui",)),
    ("runtime", ("agl.runtime",)),
    ("algorithm", ("agl.algorithm",)),
    ("top", ("agl.trainer", "agl.cli", "agl.compat", "agl")),
]
# Framework adapters sit beside the core: they may use layers up to instrumentation, and nothing above.
INTEGRATIONS_MAY_USE = {"foundation", "tracing", "openai_wire", "instrumentation", "integrations"}
ROOT_MODULES_AT_MOST = 8
MODULE_LINES_AT_MOST = 600


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {Path(__file__).name}")


def modules(core: Path, integrations: Path) -> Dict[str, Path]:
    """Every module of the package by dotted name (``integrations/x`` is ``agl.integrations.x``)."""
    found: Dict[str, Path] = {}
    for base, prefix in ((core, ["agl"]), (integrations, ["agl", "integrations"])):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(prefix + parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.stmt]:
    """Import statements anywhere in the module (functions too), leaving out ``if TYPE_CHECKING:`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for other in node.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _import_nodes(node)


def imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The agl modules ``module`` imports; ``from agl.x import name`` counts as ``agl.x.name`` when that is
    a module, else as ``agl.x``."""
    is_package = path.name == "__init__.py"
    found: Set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == "agl" or a.name.startswith("agl."))
            continue
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source != "agl" and not source.startswith("agl."):
            continue
        for alias in node.names:
            found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    found.discard(module)
    return found


def graph(core: Path = CORE, integrations: Path = INTEGRATIONS) -> Dict[str, Set[str]]:
    found = modules(core, integrations)
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def upward_imports(edges: Dict[str, Set[str]]) -> List[str]:
    problems = []
    for module, imported in sorted(edges.items()):
        mine = layer_of(module)
        for target in sorted(imported):
            theirs = layer_of(target)
            if module.startswith("agl.integrations.") and LAYERS[theirs][0] not in INTEGRATIONS_MAY_USE:
                problems.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
            elif theirs > mine:
                problems.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    return problems


def import_circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in edges:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_each_layer_imports_only_its_own_and_lower_layers():
    assert upward_imports(graph()) == []


def test_no_import_circles():
    assert import_circles(graph()) == []


def test_the_package_root_stays_small():
    root_modules = sorted(p.name for p in CORE.glob("*.py"))
    assert len(root_modules) <= ROOT_MODULES_AT_MOST, root_modules


def test_no_module_is_over_600_lines():
    """A module over 600 lines has grown two jobs: split it by what each part does (docs/architecture.md)."""
    sizes = {path: len(path.read_text().splitlines()) for base in (CORE, INTEGRATIONS) for path in base.rglob("*.py")}
    too_long = sorted(f"{path.relative_to(ROOT)}: {n} lines" for path, n in sizes.items() if n > MODULE_LINES_AT_MOST)
    assert too_long == []


@pytest.mark.parametrize(
    "module_file, planted, expected",
    [
        ("tracing/tracer.py", "from agl.store import open_store\n", "agl.tracing.tracer (tracing) imports agl.store"),
        (
            "types.py",
            "def later():\n    from agl.runtime import runner\n",
            "agl.types (foundation) imports agl.runtime.runner",
        ),
    ],
)
def test_a_planted_upward_import_is_found(tmp_path, module_file, planted, expected):
    """The check can fail: an upward import planted in a copy of the package (also inside a function)."""
    core = tmp_path / "agl"
    shutil.copytree(CORE, core, ignore=shutil.ignore_patterns("__pycache__"))
    with open(core / module_file, "a") as f:
        f.write("\n" + planted)
    problems = upward_imports(graph(core, INTEGRATIONS))
    assert any(p.startswith(expected) for p in problems), problems


def test_a_planted_circle_is_found(tmp_path):
    core = tmp_path / "agl"
    shutil.copytree(CORE, core, ignore=shutil.ignore_patterns("__pycache__"))
    with open(core / "errors.py", "a") as f:
        f.write("\nfrom agl import checks\n")
    with open(core / "checks.py", "a") as f:
        f.write("\nfrom agl import errors\n")
    assert ["agl.checks", "agl.errors"] in import_circles(graph(core, INTEGRATIONS))


def test_imports_under_type_checking_do_not_count(tmp_path):
    core = tmp_path / "agl"
    shutil.copytree(CORE, core, ignore=shutil.ignore_patterns("__pycache__"))
    with open(core / "errors.py", "a") as f:
        f.write("\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agl.trainer import Trainer\n")
    assert not [p for p in upward_imports(graph(core, INTEGRATIONS)) if p.startswith("agl.errors ")]
