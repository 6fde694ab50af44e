"""The package's import graph keeps its shape: parts import down, never up; no circle; kernels/ imports nothing of
the package; no module borrows another part's private names; the spec stands apart from the product.

The graph is read from the source (every ``import`` and ``from ... import`` of grpo_fast, at module level or inside
a function alike), not by importing it.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_fast"
# the parts, lowest first: a module may import its own part and the parts before it, never one after it
PARTS = ("kernels", "head", "distillation", "grpo_loss", "integrations", "memory")
# the spec may read the option record and the logit transform (plain records), no formula of the product
SPEC = "reference"
SPEC_MAY_IMPORT = {"grpo_fast.grpo_loss.options", "grpo_fast.head.transform"}
# the public names at the top (grpo_fast/__init__.py re-exports, grpo_fast.trl / grpo_fast.verl stand for their
# integrations): they may import anything
PUBLIC_ENTRIES = {"grpo_fast", "grpo_fast.trl", "grpo_fast.verl"}
# the longest chain of imports inside one part, and through the whole package: a few modules a part, stacked as the
# parts are (kernels 3: backward -> tile -> config; head 5: api -> vocab_parallel -> ops -> backends -> torch_twin;
# memory 4, its __main__ included), never a detour through another part's internals
MAX_PART_DEPTH = 5
MAX_DEPTH = 12


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path, name):
    """{imported grpo_fast module: [(line, names taken from it)]} of one file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("grpo_fast"):
                    found.setdefault(alias.name, []).append((node.lineno, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("grpo_fast"):
                continue
            for alias in node.names:
                # `from package import module` takes a module; `from module import name` a name of it
                candidate = f"{target}.{alias.name}"
                if _is_module(candidate):
                    found.setdefault(candidate, []).append((node.lineno, []))
                else:
                    found.setdefault(target, []).append((node.lineno, [alias.name]))
    return found


def _is_module(name):
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return modules, {name: _imports(path, name) for name, path in modules.items()}


def _part(module):
    rest = module.split(".")[1:]
    return rest[0] if rest else None


MODULES, GRAPH = _graph()


def test_the_parts_are_the_packages_folders():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(PARTS)
    for part in PARTS:  # each part says what it is, in a line a newcomer reads in the tree
        assert ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text())), part


def test_parts_import_down_never_up():
    wrong = []
    for module, imports in GRAPH.items():
        if module in PUBLIC_ENTRIES or _part(module) == SPEC:
            continue
        rank = PARTS.index(_part(module))
        for target, uses in imports.items():
            part = _part(target)
            if part == SPEC:
                wrong.append(f"{module}:{uses[0][0]} imports the spec ({target})")
            elif part in PARTS and PARTS.index(part) > rank:
                wrong.append(f"{module}:{uses[0][0]} imports {target}, a part above it")
    assert not wrong, "\n".join(wrong)


def test_kernels_import_nothing_of_the_package_above_them():
    wrong = [
        f"{module}:{uses[0][0]} imports {target}"
        for module, imports in GRAPH.items()
        if _part(module) == "kernels"
        for target, uses in imports.items()
        if _part(target) != "kernels"
    ]
    assert not wrong, "\n".join(wrong)


def test_the_spec_reads_records_only():
    imports = GRAPH[f"grpo_fast.{SPEC}"]
    assert set(imports) <= SPEC_MAY_IMPORT, sorted(set(imports) - SPEC_MAY_IMPORT)


def test_no_module_borrows_another_parts_private_names():
    wrong = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        # names bound to modules of another part: `from grpo_fast.x import module as alias`
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_fast"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if not _is_module(target) and alias.name.startswith("_") and _part(node.module) != _part(module):
                        wrong.append(f"{module}:{node.lineno} imports {alias.name} from {node.module}")
                    if _is_module(target):
                        aliases[alias.asname or alias.name] = target
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("grpo_fast") and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and _part(aliases[node.value.id]) != _part(module)
            ):
                wrong.append(f"{module}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def _edges():
    return {m: {t for t in imports if t in GRAPH and t != m} for m, imports in GRAPH.items()}


def test_no_circle():
    edges = _edges()
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                pytest.fail("import circle: " + " -> ".join(stack[stack.index(target) :] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)


def _longest_chain(edges):
    depth = {}

    def longest(module):
        if module not in depth:
            depth[module] = 1 + max((longest(t) for t in edges[module]), default=0)
        return depth[module]

    deepest = max(edges, key=longest)
    return deepest, longest(deepest)


def test_the_import_depth_follows_from_the_parts():
    edges = _edges()
    deepest, depth = _longest_chain(edges)
    assert depth <= MAX_DEPTH, f"{deepest}: {depth} modules deep"
    for part in PARTS:
        inside = {m: {t for t in ts if _part(t) == part} for m, ts in edges.items() if _part(m) == part}
        deepest, depth = _longest_chain(inside)
        assert depth <= MAX_PART_DEPTH, f"{deepest}: {depth} modules deep inside {part}/"
