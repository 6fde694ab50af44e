"""The README as a product page; the repository links in the READMEs: every relative link names a file or folder
that exists (the documentation site checks its own links: `mkdocs build --strict`); and the code the pages show:
every signature is the code's, every call takes keywords the function takes."""

import ast
import inspect
import re
import shutil
import subprocess
import textwrap
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("readme", ["README.md", "examples/README.md", "bench/README.md"])
def test_relative_links_resolve(readme):
    path = ROOT / readme
    missing = [
        target
        for target in LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert not missing, f"{readme}: links to missing paths {missing}"


def test_readme_calls_the_loss_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_call = next(i for i, line in enumerate(lines, 1) if "grpo_fast.loss(" in line)
    assert first_call <= 60, f"the first grpo_fast.loss( call is on line {first_call}"
    assert 150 <= len(lines) <= 250, f"README.md has {len(lines)} lines"


# how a GPU run was obtained (a machine's loan, its calls and their limits) is not the project's business
NOT_THE_PROJECTS_WORDS = re.compile(
    r"\bleases?\b|\blent (GPU|CUDA|machine)|device (tool|calls?|time)|budget_left|gpu_lease", re.IGNORECASE
)


def test_tracked_files_speak_of_the_project_only():
    """The docs, tools and results say what ran and what it found, never how the machine was obtained."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    hits = []
    for name in files.stdout.split("\0"):
        path = ROOT / name
        if not name or path == Path(__file__) or not path.is_file() or path.suffix in (".png", ".gz", ".gguf"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if NOT_THE_PROJECTS_WORDS.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not hits, "words about how a GPU was obtained:\n" + "\n".join(hits)


# ------------------------------------------------------------------------------------------------ the code they show
DOC_PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
INLINE_CALL = re.compile(r"`grpo_fast\.(\w+)\(([^`]*)\)`")
PYTHON_BLOCK = re.compile(r"```python\n(.*?)^ *```", re.DOTALL | re.MULTILINE)


def _shown_parameters(text):
    """An inline ``grpo_fast.<name>(...)`` that shows a signature (a default or ``*`` among its parameters, every
    default a literal): its [(name, kind, default)] and whether it ends in ``...`` (more parameters follow); None
    for a call."""
    elided = text.rstrip().endswith("...")
    shown = text.rstrip().removesuffix("...").rstrip().rstrip(",")
    try:
        arguments = ast.parse(f"def f({shown}): pass").body[0].args
        kw_defaults = [None if d is None else ast.literal_eval(d) for d in arguments.kw_defaults]
        defaults = [ast.literal_eval(d) for d in arguments.defaults]
    except (SyntaxError, ValueError):
        return None
    if not (defaults or arguments.kwonlyargs or arguments.vararg):
        return None
    empty, P = inspect.Parameter.empty, inspect.Parameter
    positional = arguments.posonlyargs + arguments.args
    padded = [empty] * (len(positional) - len(defaults)) + defaults
    parameters = [(a.arg, P.POSITIONAL_OR_KEYWORD, d) for a, d in zip(positional, padded)]
    parameters += [
        (a.arg, P.KEYWORD_ONLY, empty if d is None and k is None else d)
        for a, d, k in zip(arguments.kwonlyargs, kw_defaults, arguments.kw_defaults)
    ]
    if arguments.kwarg is not None:
        parameters.append((arguments.kwarg.arg, P.VAR_KEYWORD, empty))
    return parameters, elided


def _written(parameters):
    """[(name, kind, default)] as a signature's text."""
    written, keyword_only = [], False
    for name, kind, default in parameters:
        if kind is inspect.Parameter.KEYWORD_ONLY and not keyword_only:
            written.append("*")
            keyword_only = True
        prefix = "**" if kind is inspect.Parameter.VAR_KEYWORD else ""
        written.append(prefix + name + ("" if default is inspect.Parameter.empty else f"={default!r}"))
    return ", ".join(written)


def _inline_spans():
    for page in DOC_PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for name, text in INLINE_CALL.findall(line):
                yield f"{page.name}:{number}", name, text


def test_every_signature_a_page_shows_is_the_code():
    """Names, order, keyword-only or not and defaults; a signature that shows only its first parameters ends in
    ``...``."""
    import grpo_fast

    checked, wrong = 0, []
    for where, name, text in _inline_spans():
        shown = _shown_parameters(text)
        if shown is None:
            continue
        parameters, elided = shown
        code = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(grpo_fast, name)).parameters.values()]
        expected = code[: len(parameters)] if elided else code
        if parameters != expected:
            wrong.append(f"{where}: grpo_fast.{name}({_written(parameters)}), the code: ({_written(expected)})")
        checked += 1
    assert not wrong, "\n".join(wrong)
    assert checked >= 7  # api.md's table of entry points


def _taken(function):
    """The keyword names ``function`` takes (its parameters and its **keywords' TypedDict's) and its positional
    count."""
    parameters = inspect.signature(function).parameters.values()
    names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for p in parameters:
        if p.kind is p.VAR_KEYWORD:
            names |= set(typing.get_args(typing.get_type_hints(function)[p.name])[0].__annotations__)
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
    return names, positional


def _calls():
    """Every ``grpo_fast.<name>(...)`` call in the pages' Python blocks and inline code: (where, name, call node)."""
    for page in DOC_PAGES:
        text = page.read_text()
        sources = [
            (textwrap.dedent(m.group(1)), text[: m.start()].count("\n") + 2) for m in PYTHON_BLOCK.finditer(text)
        ]
        sources += [
            (f"grpo_fast.{name}({args})", int(where.split(":")[1]))
            for where, name, args in _inline_spans()
            if where.startswith(page.name + ":") and _shown_parameters(args) is None
        ]
        for source, first_line in sources:
            try:
                tree = ast.parse(source)
            except SyntaxError as error:
                raise AssertionError(f"{page.name}:{first_line}: a Python block that is not Python: {error}") from None
            for node in ast.walk(tree):
                func = node.func if isinstance(node, ast.Call) else None
                if (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "grpo_fast"
                ):
                    yield f"{page.name}:{first_line + node.lineno - 1}", func.attr, node


def test_every_call_a_page_shows_takes_keywords_the_code_takes():
    import grpo_fast

    checked, wrong = 0, []
    for where, name, call in _calls():
        names, positional = _taken(getattr(grpo_fast, name))
        unknown = [k.arg for k in call.keywords if k.arg is not None and k.arg not in names]
        elided = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in call.args)
        if unknown or (not elided and len(call.args) > positional):
            wrong.append(f"{where}: grpo_fast.{name}: keywords {unknown}, {len(call.args)} positional")
        checked += 1
    assert not wrong, "\n".join(wrong)
    assert checked >= 20
