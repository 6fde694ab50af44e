"""The sampling parameters' log-prob pass without gradients from the record sweep's tile candidates: the log-prob's
own forward (``kernels.forward``: one GEMM sweep, no logits in memory) also keeps, of each vocabulary tile, a row's
largest distinct logits with their counts and the largest logit they leave out; the kept set is chosen from those.
The Triton backend's path for the old and reference policies' support log-probs (``grpo_fast.sampler_logprobs``
under ``torch.no_grad``, or of tensors that need no gradient).

Math. Per row: each tile's candidates (value v, count c: how many of the tile's logits equal v), b the largest logit
no candidate holds (over every tile), and the record's m, s = sum exp(z - m), its non-target part, z_y. Of the
largest ``LISTED`` candidate entries, sorted:
* min-p's floor m + log(min_p) (as ``support_rows``); top-k's k-th logit: the value where the counts' running sum
  reaches k; top-p over the survivors' masses c exp(v - m), summed in fp64 from the top (a tie group shares the mass
  strictly above it), against their total: s, or after a floor the candidates' mass at or above it;
* a row is resolved where b lies below what the candidates must show: tau (every logit >= tau is a candidate, with
  its count), a floor before top-p (the survivors' total), and with top-p the first listed survivor that falls out
  (the cut lies in the list; b equal to it adds nothing strictly above it), or every survivor listed and kept.
Then kept = sum_{v >= tau} c exp(v - m) and its non-target part, the same sum with the target's count one less (the
target's logit is bitwise a candidate's: the same tile computed both): a sum over the others, never a difference.

Rows not resolved (a tile that holds more of the top than its candidates: ~4e-4 of the rows at random placement;
more with many ties, and under top-p where the cut lies past the list; a NaN or an all -inf row) go whole to the
rows' path (``support_rows``): each row's record comes from one path, so its log-prob, threshold and sums agree.

Only without gradients: a backward recomputes the rows by cuBLAS (``support_twin.parameter_backward``), whose
rounding is not the tile's, so a logit at tau could leave the set it was counted in. With gradients the rows' path
gives the forward in the backward's arithmetic. Vocab-parallel heads take the rows' path too.

Cost (argued from the compiled code until a GPU times it, ``docs/sampler-support.md``): the log-prob's record sweep
with 3 rounds of a row max, a compare and a count per tile (~4 operations a logit beside the GEMM's 2 D), 7 fp32 a
row and tile written (7 / 128 of the logits' count, within ``kernels.forward.PARTS_BYTES`` a launch), then a top-64
of 3 x tiles entries a row (3561 at V = 151936 in 128 columns) and a few [rows, 3 x tiles] passes a chunk.
"""

from __future__ import annotations

import math

import torch

from grpo_fast.backends import support_rows, support_twin
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels.operands import HeadOperands, SamplerSupport, SupportRecord

# the largest candidate entries a row's selection sorts: top-k up to it can be resolved here
LISTED = 64


def serves(support: SamplerSupport, reduce, differentiable: bool) -> bool:
    """Whether this path computes the support: the sampling parameters with top-k 0 or up to ``LISTED``, one
    process's whole head, no gradient."""
    one_process = reduce is None or reduce is support_twin.ONE_PROCESS
    return support.kept_ids is None and support.top_k <= LISTED and one_process and not differentiable


def parameter_forward(head: HeadOperands, support: SamplerSupport, config, rows_forward) -> SupportRecord:
    """The SupportRecord of ``head``'s rows (module docstring); ``config``: ``kernels.forward``'s launch;
    ``rows_forward(head, support) -> SupportRecord``: the rows' path, for the rows the candidates do not resolve."""
    N, V = head.hidden.shape[0], head.weight.shape[0]
    device = head.hidden.device
    record = SupportRecord(*(torch.empty(N, dtype=torch.float32, device=device) for _ in SupportRecord._fields))
    resolved = torch.zeros(N, dtype=torch.bool, device=device)

    def select(n0, n1, candidates, stats):
        m, s, rest, _, target_logit = stats.unbind(0)
        tau, kept, kept_rest, resolved[n0:n1] = _select(candidates, m, s, target_logit, support, V)
        support_rows.fill_record(record, slice(n0, n1), target_logit, m, (s, rest), tau, (kept, kept_rest))

    kforward.forward_record(head, False, config, tile_candidates=select)
    pending = (~resolved).nonzero().squeeze(-1)
    if pending.numel():
        for field, values in zip(record, rows_forward(_rows_of(head, pending), support)):
            field[pending] = values
    return record


def _rows_of(head: HeadOperands, index) -> HeadOperands:
    lora = (head.lora[0][index].contiguous(), head.lora[1]) if head.lora is not None else None
    return head._replace(hidden=head.hidden[index].contiguous(), targets=head.targets[index].contiguous(), lora=lora)


def _mass_at_or_above(values, weights, floor):
    """[n] sum of ``weights`` over the entries v >= floor."""
    return torch.where(values >= floor[:, None], weights, 0.0).sum(-1)


def _at(x, index):
    return x.gather(-1, index[:, None]).squeeze(-1)


def _select(candidates, m, s, target_logit, support: SamplerSupport, vocab_size):
    """(tau, kept, kept_rest, resolved) [n] of a launch's rows from its tiles' candidates [fields, tiles, n]."""
    C = kforward.TILE_CANDIDATES
    n = m.shape[0]
    values = candidates[0 : 2 * C : 2].permute(2, 0, 1).reshape(n, -1)
    counts = candidates[1 : 2 * C : 2].permute(2, 0, 1).reshape(n, -1)
    beyond = candidates[2 * C].amax(0)
    listed, index = values.topk(min(LISTED, values.shape[-1]), dim=-1)
    listed_counts = counts.gather(-1, index)
    L = listed.shape[-1]
    e = torch.exp(values - m[:, None])  # each candidate's exp(v - m), once
    resolved = torch.isfinite(m) & torch.isfinite(s) & ~torch.isnan(target_logit)
    floor = torch.full_like(m, -math.inf)
    if support.min_p > 0:
        floor = m + math.log(support.min_p)
    if 0 < support.top_k < vocab_size:
        at = (listed_counts.cumsum(-1) < support.top_k).sum(-1)
        resolved &= at < L
        floor = torch.maximum(floor, _at(listed, at.clamp(max=L - 1)))
    tau = floor
    if support.top_p < 1:
        cut = floor > -math.inf
        resolved &= ~cut | (beyond < floor)
        total = torch.where(cut, _mass_at_or_above(values, counts * e, floor).double(), s.double())
        survivors = listed >= floor[:, None]
        mass = torch.where(survivors, listed_counts.double() * torch.exp(listed - m[:, None]).double(), 0.0)
        kept = survivors & (support_twin.mass_strictly_above(listed, mass) < support.top_p * total[:, None])
        j = kept.sum(-1)
        out = j.clamp(max=L - 1)
        falls_out = (j < L) & _at(survivors, out) & (beyond <= _at(listed, out))
        every_survivor = (beyond < floor) & (survivors.sum(-1) == (values >= floor[:, None]).sum(-1))
        resolved &= (j >= 1) & (falls_out | every_survivor)
        tau = _at(listed, (j - 1).clamp(min=0))
    resolved &= beyond < tau
    first = values == target_logit[:, None]
    first &= first.cumsum(-1) == 1
    kept = _mass_at_or_above(values, counts * e, tau)
    kept_rest = _mass_at_or_above(values, (counts - first.float()) * e, tau)
    return tau, kept, kept_rest, resolved
