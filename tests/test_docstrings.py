"""The API reference's docstrings keep their format: Google style, as mkdocstrings renders it (mkdocs.yml).

Every public function, class and method that the API reference pages render (docs/reference/: ``grpo_fast``'s
``__all__``, the public names of grpo_fast.trl, grpo_fast.verl and grpo_fast.memory) has a docstring that griffe,
the docs' own parser, reads without a warning; its ``Args:`` name exactly the signature's parameters (none missing,
none stale; the loss-option keywords of ``loss`` and ``token_loss`` are documented once, in LossOptions, which their
docstrings link); a function that returns a value has ``Returns:``; a class documents its own constructor's parameters
(Args, or Attributes for a dataclass). griffe reads the source without importing it, so grpo_fast.trl and grpo_fast.verl
are checked without TRL or verl; it comes with the docs extra and is listed in the test extra for this test.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import re
import textwrap
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parents[1]
# the framework modules with a reference page of their own (docs/reference/*.md)
PAGE_MODULES = ("integrations.trl", "integrations.verl", "memory")
# a parameter the docstring does not name: the bound instance
IMPLICIT = {"self", "cls"}


def _load():
    return griffe.load(
        "grpo_fast",
        search_paths=[str(ROOT)],
        allow_inspection=False,
        docstring_parser="google",
        resolve_aliases=True,
        resolve_external=False,
    )


def _resolved(obj):
    """The object an exported name stands for; None for another package's (TRL's GRPOConfig: not rendered here)."""
    try:
        return obj.final_target if obj.is_alias else obj
    except griffe.AliasResolutionError:
        return None


def _rendered(package):
    """(path, object) of every function and class the reference pages render, and of their public methods."""
    roots = [_resolved(package[name]) for name in package.exports]
    for name in PAGE_MODULES:
        module = package[name]
        names = module.exports if module.exports is not None else [n for n in module.members if not n.startswith("_")]
        roots += [_resolved(module[n]) for n in names]
    seen = {}
    for obj in roots:
        if obj is None or not (obj.is_function or obj.is_class):
            continue
        seen.setdefault(obj.path, obj)
        if obj.is_class:
            for name, member in obj.members.items():
                if not name.startswith("_") and not member.is_alias and member.is_function:
                    seen.setdefault(member.path, member)
    return sorted(seen.items())


def _parameters(obj):
    return [p.name for p in obj.parameters if p.name not in IMPLICIT]


PACKAGE = _load()
RENDERED = _rendered(PACKAGE)


def _sections(obj, caplog):
    """The docstring's sections and griffe's warnings while it parsed them (missing types are fine: the signature's
    annotations give them where written)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="griffe"):
        sections = griffe.parse_google(obj.docstring, warn_missing_types=False)
    return sections, [record.getMessage() for record in caplog.records]


def _named(sections, kind):
    """The names a section documents (``*args`` and ``**kwargs`` as the parameters' names)."""
    return [item.name.lstrip("*") for section in sections if section.kind is kind for item in section.value]


def _returns_value(obj):
    """The function's own body (not a nested def) returns or yields a value (a context manager's bare ``yield``
    gives none)."""
    tree = ast.parse(textwrap.dedent(obj.source))
    function = tree.body[0]

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.YieldFrom) or (isinstance(child, ast.Yield) and child.value is not None):
                return True
            if (
                isinstance(child, ast.Return)
                and child.value is not None
                and not (isinstance(child.value, ast.Constant) and child.value.value is None)
            ):
                return True
            if walk(child):
                return True
        return False

    return walk(function)


def _is_abstract(obj):
    """The body only raises NotImplementedError (a base method subclasses override): its Returns describes theirs."""
    body = [
        node
        for node in ast.parse(textwrap.dedent(obj.source)).body[0].body
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
    ]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0].exc)


def _documented_base_method(obj):
    """The same-named method of a base class in this package that has a docstring with sections, or None."""
    if not obj.is_function or obj.parent is None or not obj.parent.is_class:
        return None
    for base in obj.parent.resolved_bases:
        method = base.members.get(obj.name)
        if (
            method is not None
            and method.docstring is not None
            and ("Args:" in method.docstring.value or "Returns:" in method.docstring.value)
        ):
            return method
    return None


def test_the_reference_renders_the_public_api():
    paths = {path for path, _ in RENDERED}
    for path in (
        "grpo_fast.grpo_loss.api.loss",
        "grpo_fast.grpo_loss.api.token_loss",
        "grpo_fast.grpo_loss.options.LossOptions",
        "grpo_fast.distillation.api.divergence_and_entropy",
        "grpo_fast.integrations.trl.add_fused_lm_head",
        "grpo_fast.integrations.verl.forward",
        "grpo_fast.memory.estimate",
    ):
        assert path in paths


@pytest.mark.parametrize("path", [path for path, _ in RENDERED])
def test_docstring_documents_the_signature(path, caplog):
    obj = dict(RENDERED)[path]
    assert obj.docstring is not None and obj.docstring.value.strip(), f"{path} has no docstring"
    summary = obj.docstring.value.strip().splitlines()[0]
    assert summary.strip(), f"{path}: the docstring's first line is its summary"
    sections, warnings = _sections(obj, caplog)
    assert not warnings, f"{path}: griffe's Google-style parser warns: {warnings}"
    base = _documented_base_method(obj)
    if base is not None and not sections[1:] and _parameters(base) == _parameters(obj):
        return  # an override of a documented base method: its summary; the base's docstring has the sections
    args = _named(sections, griffe.DocstringSectionKind.parameters)
    assert len(args) == len(set(args)), f"{path}: a parameter documented twice: {args}"
    if obj.is_class:
        if "__init__" not in obj.members and "dataclass" not in obj.labels:
            return  # an inherited constructor: its class documents it
        documented = args + _named(sections, griffe.DocstringSectionKind.attributes)
        expected = _parameters(obj)
        assert sorted(set(documented) & set(expected)) == sorted(expected), (
            f"{path}: constructor parameters not documented (Args or Attributes): "
            f"{sorted(set(expected) - set(documented))}"
        )
        return
    expected = _parameters(obj)
    assert sorted(args) == sorted(expected), (
        f"{path}: Args must name exactly the signature's parameters; missing {sorted(set(expected) - set(args))}, "
        f"stale {sorted(set(args) - set(expected))}"
    )
    if "property" in obj.labels or _is_abstract(obj):
        return
    has_returns = any(
        s.kind in (griffe.DocstringSectionKind.returns, griffe.DocstringSectionKind.yields) for s in sections
    )
    if _returns_value(obj):
        assert has_returns, f"{path} returns a value: its docstring needs a Returns section"
    else:
        assert not has_returns, f"{path} returns nothing but documents Returns"


# mkdocs markup: a cross-reference [title][identifier] or a link [title](target)
MARKUP = re.compile(r"\[[^\]\n]*\]\[[\w.]*\]|\[[^\]\n]*\]\([^)\s]*\)")


def _plain_references():
    """docs/plain_references.py, the reference's griffe extension (mkdocs.yml), as a module."""
    spec = importlib.util.spec_from_file_location("plain_references", ROOT / "docs" / "plain_references.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docstrings_are_plain_text():
    """help() and an IDE show a docstring as written: no mkdocs markup in any docstring of the package (the site
    links the plain ``grpo_fast.X`` and docs/page.md: docs/plain_references.py), nor in what help() shows of the
    public names and their methods."""
    marked = [
        f"{obj.path}: {MARKUP.search(obj.docstring.value)[0]}"
        for obj in _plain_references().objects(PACKAGE)
        if obj.docstring is not None and MARKUP.search(obj.docstring.value)
    ]
    import grpo_fast

    for name in grpo_fast.__all__:
        public = getattr(grpo_fast, name)
        for obj in [public, *(vars(public).values() if inspect.isclass(public) else ())]:
            doc = inspect.getdoc(obj) if callable(obj) or obj is public else None
            if doc and MARKUP.search(doc):
                marked.append(f"grpo_fast.{name}: {MARKUP.search(doc)[0]}")
    assert not marked, "mkdocs markup in docstrings:\n" + "\n".join(marked)


def test_the_reference_links_the_names_and_pages_docstrings_give():
    """The extension over the package as mkdocs loads it: every ``grpo_fast.X`` a docstring names is an object of
    the package and every docs/page.md a page (else it raises), and both become links."""
    extension = _plain_references()
    package = griffe.load(
        "grpo_fast",
        search_paths=[str(ROOT)],
        allow_inspection=False,
        extensions=griffe.load_extensions(extension.PlainReferences),
    )
    loss = package["grpo_loss.api.loss"].docstring.value
    assert '<autoref identifier="grpo_fast.LossOptions" optional><code>grpo_fast.LossOptions</code></autoref>' in loss
    assert "[docs/options.md#metrics](../options.md#metrics)" in loss
    collection = package.modules_collection
    with pytest.raises(ValueError, match="names grpo_fast.no_such_name, which is no object of the package"):
        extension.linked("``grpo_fast.no_such_name``", collection, "here")
    with pytest.raises(ValueError, match="names docs/no-such-page.md, which is no page of the site"):
        extension.linked("docs/no-such-page.md", collection, "here")
    assert extension.linked("see bench/docs/x.md and ``docs/x.md``", collection, "here") == (
        "see bench/docs/x.md and ``docs/x.md``"
    )
