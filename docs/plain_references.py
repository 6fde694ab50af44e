"""A griffe extension for the API reference (mkdocs.yml): docstrings stay plain text, as ``help()`` and an IDE show
them, and the site links what they name.

- ``grpo_fast.X`` (a double-backticked dotted name of the package) becomes a link to X where the reference renders
  it: an optional autoref, plain code where it does not.
- docs/page.md or docs/page.md#anchor (a page of this site) becomes a link to it; the reference pages are
  docs/reference/*.md, one level down.

A name that is no object of the package, or a page that does not exist, fails the build (``tests/test_docstrings.py``
runs it over every docstring).
"""

import re
from pathlib import Path

import griffe

DOCS = Path(__file__).resolve().parent
# ``grpo_fast.name``: an object of the package, as a docstring names it
OBJECT = re.compile(r"``(grpo_fast(?:\.\w+)+)``")
# docs/page.md or docs/page.md#anchor: a page of this site, as a docstring names it (not in a code span or a path)
PAGE = re.compile(r"(?<![`/\w])docs/([\w-]+\.md)(#[\w-]+)?")


class PlainReferences(griffe.Extension):
    """Links the names and pages that the package's docstrings write in plain text (the module docstring)."""

    def on_package(self, *, pkg, loader, **kwargs):
        for obj in objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = linked(obj.docstring.value, loader.modules_collection, obj.path)


def linked(text, collection, where):
    """``text`` (a docstring) with its objects and pages as links; ``collection``: griffe's loaded modules, ``where``:
    the docstring's object, for the error."""

    def object_link(match):
        path = match[1]
        try:
            collection.get_member(path)
        except (KeyError, ValueError) as error:
            raise ValueError(f"{where}'s docstring names {path}, which is no object of the package") from error
        return f'<autoref identifier="{path}" optional><code>{path}</code></autoref>'

    def page_link(match):
        page, anchor = match[1], match[2] or ""
        if not (DOCS / page).is_file():
            raise ValueError(f"{where}'s docstring names docs/{page}, which is no page of the site")
        return f"[docs/{page}{anchor}](../{page}{anchor})"

    return PAGE.sub(page_link, OBJECT.sub(object_link, text))


def objects(obj):
    """``obj`` and every object defined in it (aliases, names imported from elsewhere, are their module's)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from objects(member)
