"""The package's import graph keeps its shape: parts import down, never up; no circle; kernels/ imports nothing of
the package; no module borrows another part's private names; the spec stands apart from the product. And the rules
that keep each choice in one place: only the backends launch kernels; one module classifies a GPU architecture
(kernels/tiles.py); one compares a backend's name (backends/resolver.py); no file of the package grows past 800
lines.

The graph is read from the source (every ``import`` and ``from ... import`` of grpo_fast, at module level or inside
a function alike), not by importing it.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_fast"
# the parts, lowest first: a module may import its own part and the parts before it, never one after it
PARTS = (
    "kernels",
    "backends",
    "head",
    "sampler",
    "distillation",
    "served",
    "multi_teacher",
    "grpo_loss",
    "integrations",
    "memory",
)
# the spec may read the option record and the logit transform (plain records), no formula of the product
SPEC = "reference"
SPEC_MAY_IMPORT = {"grpo_fast.grpo_loss.options", "grpo_fast.head.transform"}
# the public names at the top (grpo_fast/__init__.py re-exports, grpo_fast.trl / grpo_fast.verl stand for their
# integrations): they may import anything
PUBLIC_ENTRIES = {"grpo_fast", "grpo_fast.trl", "grpo_fast.verl"}
# the longest chain of imports inside one part, and through the whole package: a few modules a part, stacked as the
# parts are (kernels 5: divergence_loss -> divergence_gradient -> divergence_tile -> tile -> launch; backends 4:
# resolver -> torch_backend -> divergence_twin -> head_twin; head 4: api -> vocab_parallel -> ops -> boundary; memory
# 4 to grpo_loss, its __main__ included), never a detour through another part's internals: memory 4, grpo_loss 2
# (api -> call), head 3, backends 2 (resolver -> triton_backend), kernels 5; the sampler's part between head and
# grpo_loss adds one level to loss's chain (grpo_loss.api -> grpo_loss.sampling -> sampler.call -> head.vocab_parallel),
# the memory estimate's sampler head one more (memory 6: __main__ -> memory -> command -> sampler -> heads -> recipe)
MAX_PART_DEPTH = 6
MAX_DEPTH = 18
# the one module that maps a compute capability to its tiles, and the one that turns a backend's name into the backend
ARCH_CLASSIFIER = "grpo_fast.kernels.tiles"
BACKEND_RESOLVER = "grpo_fast.backends.resolver"
BACKEND_NAMES = {"auto", "triton", "torch"}
# a name that holds a compute capability (or its major part)
ARCH_NAMES = {"arch", "capability", "compute_capability", "major", "cc"}
MAX_FILE_LINES = 800


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


def _compares(tree):
    """Every comparison of values in the module (not an identity test: ``is None``): (line, its operands' nodes)."""
    return [
        (node.lineno, [node.left, *node.comparators])
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
    ]


def _names_in(node):
    """The identifiers a node reads (names and attributes)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def test_one_module_classifies_an_architecture():
    # a card's row is tiles.arch_class's to choose: nowhere else is a compute capability compared
    wrong = []
    for module, path in MODULES.items():
        if module == ARCH_CLASSIFIER:
            continue
        for line, operands in _compares(ast.parse(path.read_text())):
            if any(_names_in(x) & ARCH_NAMES for x in operands):
                wrong.append(f"{module}:{line} compares a compute capability")
    assert not wrong, "\n".join(wrong)


def test_no_backend_name_is_compared_outside_the_resolver():
    # the resolver turns a name into the backend object, whose methods and flags the parts ask instead
    wrong = []
    for module, path in MODULES.items():
        if module == BACKEND_RESOLVER:
            continue
        for line, operands in _compares(ast.parse(path.read_text())):
            strings = {x.value for x in operands if isinstance(x, ast.Constant) and isinstance(x.value, str)}
            tuples = {
                e.value
                for x in operands
                if isinstance(x, (ast.Tuple, ast.List, ast.Set))
                for e in x.elts
                if isinstance(e, ast.Constant)
            }
            named_backend = any("backend" in name for x in operands for name in _names_in(x))
            if (strings | tuples) & BACKEND_NAMES and named_backend:
                wrong.append(f"{module}:{line} compares a backend's name")
    assert not wrong, "\n".join(wrong)


def _launchers():
    """The kernels modules that launch Triton kernels: those that define a @triton.jit function, and those that import
    one of them."""
    jit = {
        module for module, path in MODULES.items() if _part(module) == "kernels" and "@triton.jit" in path.read_text()
    }
    launchers, grew = set(jit), True
    while grew:
        grew = False
        for module, imports in GRAPH.items():
            if _part(module) == "kernels" and module not in launchers and launchers & set(imports):
                launchers.add(module)
                grew = True
    return launchers


def test_only_the_backends_launch_kernels():
    # a part above asks its backend (grpo_fast.backends.protocol.Backend); nothing calls a kernel around it
    launchers = _launchers()
    assert {"grpo_fast.kernels.forward", "grpo_fast.kernels.divergence_loss"} <= launchers  # the rule reads them
    wrong = [
        f"{module}:{uses[0][0]} imports {target}"
        for module, imports in GRAPH.items()
        if _part(module) not in ("kernels", "backends")
        for target, uses in imports.items()
        if target in launchers
    ]
    assert not wrong, "\n".join(wrong)
    # layer 2's ops reach every computation through the backend: not one kernels module, records included
    assert not [t for t in GRAPH["grpo_fast.grpo_loss.ops"] if _part(t) == "kernels"]


def test_no_file_of_the_package_is_over_800_lines():
    long = {module: n for module, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long
