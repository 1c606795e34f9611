"""The package's layers, as each folder's docstring states them ("May import: ..."), hold:
every import of every module (those inside functions too) goes to its own folder or to one
the importing folder's docstring names, and no modules import each other in a circle."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = "windowgpt_cli"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
GROUND = "ground"
EVERY_FOLDER = "every folder"


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
FOLDERS = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))


def unit(module: str) -> str:
    """The folder a module lives in, or "ground" for the package's top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDERS) else GROUND


def imports(module: str) -> set[str]:
    """The package's modules that `module` imports anywhere in its file (a name imported
    from a package counts as that package's module where one exists)."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == PACKAGE:
                target = node.module
            else:
                continue
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return {m for m in found if m in MODULES and m != module}


def allowed(folder: str) -> set[str]:
    """What a folder's (or, for "ground", the package's) docstring says it may import."""
    init = ROOT / "__init__.py" if folder == GROUND else ROOT / folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    match = re.search(r"^May import: (.+)\.$", doc, re.MULTILINE)
    assert match, f"{init}: its docstring does not say what the folder may import (May import: ...)"
    names = {name.strip() for name in match.group(1).split(",")}
    return names


def permits(importer: str, target: str) -> bool:
    rule = allowed(unit(importer))
    if unit(importer) == unit(target) or EVERY_FOLDER in rule:
        return True
    if unit(target) == GROUND:  # ground modules by name, or all of them as "ground"
        return GROUND in rule or target.split(".")[-1] in rule
    return unit(target) in rule


def test_every_folder_says_what_it_holds_and_may_import():
    for folder in [GROUND, *FOLDERS]:
        names = allowed(folder)
        known = {GROUND, EVERY_FOLDER, *FOLDERS} | {m.split(".")[-1] for m in MODULES if unit(m) == GROUND}
        assert names <= known, (folder, names - known)


def test_no_module_imports_what_its_folder_may_not():
    broken = [f"{m} -> {t}" for m in MODULES for t in sorted(imports(m)) if not permits(m, t)]
    assert not broken, "imports that break a layer:\n" + "\n".join(broken)


def test_the_folders_form_layers_without_a_circle():
    graph = {folder: {t for t in allowed(folder) if t in FOLDERS} for folder in FOLDERS if folder != "cli"}
    assert not _cycles(graph), _cycles(graph)


def test_no_modules_import_each_other_in_a_circle():
    cycles = _cycles({m: imports(m) for m in MODULES})
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("folder, forbidden", [
    ("model", {"train", "eval", "quant", "cli"}),
    ("kernels", set(FOLDERS) - {"kernels"}),
    *[(folder, {"cli"}) for folder in FOLDERS if folder != "cli"],
])
def test_the_rules_the_layers_exist_for(folder, forbidden):
    """The model never imports training, evaluation, quantization or the command line;
    kernels import nothing of the package above the runtime; nothing imports the CLI."""
    reached = {unit(t) for m in MODULES if unit(m) == folder for t in imports(m)}
    assert not reached & forbidden, (folder, reached & forbidden)
    if folder == "kernels":
        ground = {t.split(".")[-1] for m in MODULES if unit(m) == folder for t in imports(m) if unit(t) == GROUND}
        assert ground <= {"errors", "runtime"}, ground


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
