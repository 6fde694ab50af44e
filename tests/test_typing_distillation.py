"""A type checker sees the divergence head's public signatures: mypy, run over a caller of grpo_fast.divergence and
grpo_fast.divergence_and_entropy, passes the right calls and names a keyword that does not exist, a number given a
string, a backend and a head path that are not among the choices, and the keywords given by position;
``divergence``'s keywords (DivergenceKeywords) are ``divergence_and_entropy``'s, with their types."""

import inspect
import typing

import pytest
from helpers import mypy_errors

import grpo_fast
from grpo_fast.distillation.api import DivergenceKeywords

CALLER = """
import torch

import grpo_fast

hs, ws, mask = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.ones(2, 3)
ht, wt = torch.zeros(2, 3, 6), torch.zeros(5, 6)
div: torch.Tensor = grpo_fast.divergence(hs, ws, ht, wt, mask, beta=0.5, backend="torch", head_path="general")
pair: tuple[torch.Tensor, torch.Tensor] = grpo_fast.divergence_and_entropy(
    hs, ws, ht, wt, student_softcap=30.0, student_gemm_dtype=torch.bfloat16, vocab_parallel=None
)
grpo_fast.divergence(hs, ws, ht, wt, temprature=0.9)
grpo_fast.divergence_and_entropy(hs, ws, ht, wt, beta="0.5")
grpo_fast.divergence(hs, ws, ht, wt, backend="cuda")
grpo_fast.divergence_and_entropy(hs, ws, ht, wt, head_path="frozen")
grpo_fast.divergence_and_entropy(hs, ws, ht, wt, mask, 0.5)
"""


@pytest.mark.slow
def test_mypy_checks_the_divergence_keywords(tmp_path):
    errors, result = mypy_errors(tmp_path, CALLER)
    assert errors == [
        'error: Unexpected keyword argument "temprature" for "divergence"; did you mean "temperature"?  [call-arg]',
        'error: Argument "beta" to "divergence_and_entropy" has incompatible type "str"; expected "float"  [arg-type]',
        'error: Argument "backend" to "divergence" has incompatible type "Literal[\'cuda\']"; expected '
        "\"Literal['auto', 'triton', 'torch']\"  [arg-type]",
        'error: Argument "head_path" to "divergence_and_entropy" has incompatible type "Literal[\'frozen\']"; '
        "expected \"Literal['auto', 'general']\"  [arg-type]",
        'error: Too many positional arguments for "divergence_and_entropy"  [call-arg]',
    ], result.stdout + result.stderr


def test_divergence_takes_the_keywords_of_divergence_and_entropy():
    """One list of keywords for both functions: DivergenceKeywords names divergence_and_entropy's keyword-only
    parameters, each with its type."""
    signature = inspect.signature(grpo_fast.divergence_and_entropy)
    keywords = [name for name, p in signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    hints = typing.get_type_hints(grpo_fast.divergence_and_entropy)
    assert typing.get_type_hints(DivergenceKeywords) == {name: hints[name] for name in keywords}
    assert list(DivergenceKeywords.__annotations__) == keywords
