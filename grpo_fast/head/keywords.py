"""The one error every public function raises for a keyword argument it does not take.

The error names the function, each unknown name with the name the caller likely meant (``ALIASES`` first: TRL's
names for the same inputs; else the closest of the names the function takes), and every name it takes, the
tensors' included. ``takes_keywords`` decorates a public function with it: the names are checked before Python binds
them, so a misnamed tensor (``completion_ids=``) is named as such rather than reported as a missing argument.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

# TRL 1.16's GRPOTrainer's names for inputs these functions take (its batch's keys and loss's variables, GRPOConfig's
# fields; completion_ids is also the README's), each with the name here; suggested only to a function taking that name
ALIASES = {
    "completion_ids": "targets",
    "per_token_logps": "logprobs",
    "old_per_token_logps": "old_logprobs",
    "ref_per_token_logps": "ref_logprobs",
    "sampling_per_token_logps": "sampling_logprobs",
    "importance_sampling_ratio": "importance_weights",
    "entropies": "entropy",
    "vllm_importance_sampling_mode": "mode",
    "vllm_importance_sampling_clip_max": "clip_max",
    "vllm_importance_sampling_clip_min": "clip_min",
}

F = TypeVar("F", bound=Callable[..., Any])


def _hint(name: str, taken: Sequence[str]) -> str:
    """``name`` quoted, with the name the caller likely meant where there is one."""
    meant = ALIASES.get(name)
    if meant not in taken:
        close = difflib.get_close_matches(name, taken, 1)
        meant = close[0] if close else None
    return f"{name!r} (did you mean {meant!r}?)" if meant is not None else repr(name)


def unexpected_keywords(
    caller: str, names: Iterable[str], parameters: Sequence[str], group: tuple[str, Sequence[str]] | None = None
) -> TypeError:
    """The TypeError for keyword arguments ``names`` that ``caller`` does not take.

    Args:
        caller: the public function's name.
        names: the unknown keyword names.
        parameters: the names of the function's own parameters, in order (its tensors' included).
        group: (what they are, the names) of the keywords it takes besides (e.g. the loss options), or None.

    Returns:
        The error, to raise.
    """
    grouped = tuple(group[1]) if group is not None else ()
    taken = (*parameters, *grouped)
    names = sorted(names)
    hints = ", ".join(_hint(name, taken) for name in names)
    argument = "an unexpected keyword argument" if len(names) == 1 else "unexpected keyword arguments"
    takes = ", ".join(parameters)
    if group is not None:
        takes = f"{takes}, and {group[0]} {', '.join(grouped)}" if takes else f"{group[0]} {', '.join(grouped)}"
    return TypeError(f"{caller}() got {argument} {hints}; {caller}() takes {takes}")


def takes_keywords(typed: type | None = None, label: str = "") -> Callable[[F], F]:
    """Decorates a public function: a keyword it does not take is ``unexpected_keywords``' error, raised before the
    call binds its arguments (Python's own error names no likely meaning and, for a misnamed tensor, reports a
    missing one instead).

    Args:
        typed: the TypedDict of its ``**keywords`` (PEP 692), whose names it also takes; None: it has none.
        label: what ``typed``'s names are, in the error (e.g. "the loss options").

    Returns:
        The decorator; the decorated function keeps its signature, docstring and types.
    """

    def decorate(function: F) -> F:
        parameters = tuple(
            name
            for name, parameter in inspect.signature(function).parameters.items()
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        )
        group = (label, tuple(typed.__annotations__)) if typed is not None else None
        taken = frozenset((*parameters, *(group[1] if group is not None else ())))

        @functools.wraps(function)
        def checked(*args, **kwargs):
            for name in kwargs:
                if name not in taken:
                    raise unexpected_keywords(function.__name__, set(kwargs) - taken, parameters, group)
            return function(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return decorate
