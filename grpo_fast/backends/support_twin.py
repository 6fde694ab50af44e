"""The sampler's kept set and the log-sum-exps over it and over the vocabulary (``grpo_fast.sampler_logprobs``),
in chunked PyTorch on any device; the Triton backend runs the parameters' path here too (its selection has no kernel
yet) and fills the replayed sets' products with ``kernels.kept_set``.

Math. The kept set of a row is {v : z_v >= tau} (every rule of ``SamplerSupport`` keeps the largest logits, ties with
the last kept one included); the support's log-prob of the target y is s = z_y - L, L = log sum_{z_v >= tau}
exp(z_v), the log-prob logp = z_y - lse. Gradients (tau held fixed: the set is piecewise constant in the logits):
dz_v = c [v = y] - c p_v + d [v = y] - d [z_v >= tau] q_v, with c = dL/dlogp, d = dL/ds, p = exp(z - lse), q =
exp(z - L); the target's column is c (1 - p_y) + d (1 - q_y), both carried from the forward as sums over the other
entries, never formed by cancellation (a confident token's gradient exact relative to its size).

Two ways to the kept set:
* the sampling parameters (``parameter_forward``): each chunk of token rows holds its whole rows of logits in fp32
  ([rows, V], rows from a byte budget: the buffer does not grow with the tokens), written by ``gemm.mm_fp32``
  (cuBLAS with an fp32 output from bf16 operands on a GPU), and applies the rules in vLLM's order: min-p on
  p / max p = exp(z - max z), top-k on the k-th largest survivor (``topk``), top-p on the survivors' masses sorted
  and summed in fp64 from the top, over each row's largest 64 logits where the cut lies among them, else 1024, else
  the whole row. The same rows give both log-sum-exps: one GEMM sweep forward for both outputs, one recompute in the
  backward for both gradients (then dH = g W and dW = g^T H, two more);
* the replayed sets (``replayed_forward``, ``kept_ids`` [N, K], -1 filling): the logits of the K kept entries alone
  (``KeptDots``: a gather of K weight rows a token, O(N K D), no vocabulary sweep), the log-prob left to layer 1's
  own op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_fast.kernels import gemm
from grpo_fast.kernels.operands import HeadGrads, HeadOperands, SamplerSupport, SupportRecord

# the fp32 bytes of one chunk's logit rows (and as much again for the temporaries): at V = 152k, 220 rows a chunk
ROW_BUDGET_BYTES = 1 << 27
# top-p's candidates a row: its largest 64 logits hold top_p of the mass in most rows of a language model; the
# rows where they do not try 1024, then the whole row sorted
CANDIDATES = (64, 1024)
# the bytes of one chunk's gathered kept weight rows ([rows, K, D] fp32)
GATHER_BUDGET_BYTES = 1 << 26


def _rows_per_chunk(bytes_per_row, budget):
    return max(1, budget // max(1, bytes_per_row))


def kept_threshold(z, support: SamplerSupport):
    """tau [n] fp32 of rows of logits ``z`` [n, V] under the sampling parameters (module docstring): the smallest
    kept logit; the kept set is {v : z_v >= tau}."""
    keep = torch.ones_like(z, dtype=torch.bool)
    top = z.amax(dim=-1, keepdim=True)
    if support.min_p > 0:
        keep &= torch.exp(z - top) >= support.min_p  # p_v / max p, in vLLM's fp32 softmax's terms
    V = z.shape[-1]
    if 0 < support.top_k < V:
        kth = z.masked_fill(~keep, -math.inf).topk(support.top_k, dim=-1).values[:, -1:]
        keep &= z >= kth
    if support.top_p < 1:
        return _top_p_threshold(z.masked_fill(~keep, -math.inf), top, support.top_p)
    return torch.where(keep, z, math.inf).amin(dim=-1)


def _top_p_threshold(z, top, top_p):
    """tau of top-p over the survivors z (-inf: removed) of rows whose largest logit is ``top``: the candidates
    are each row's largest CANDIDATES[i] logits, tried in turn until some candidate falls out of the kept set
    (every entry above it is a candidate, so the cut lies among them); the whole row sorted last."""
    V = z.shape[-1]
    total = torch.exp(z - top).double().sum(-1, keepdim=True)
    tau = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    pending = torch.arange(z.shape[0], device=z.device)
    for count in CANDIDATES + (V,):
        rows = z[pending]
        values = rows.topk(min(count, V), dim=-1).values if count < V else rows.sort(dim=-1, descending=True)[0]
        mass = torch.exp(values - top[pending]).double()
        above = mass.cumsum(-1) - mass  # the survivors' mass ranked above each sorted entry, unnormalised
        # an entry tied with the one before it has the mass strictly above of its tie group's first entry
        first = torch.ones_like(values, dtype=torch.bool)
        first[:, 1:] = values[:, 1:] != values[:, :-1]
        index = torch.arange(values.shape[-1], device=z.device).expand_as(values)
        strictly_above = above.gather(-1, torch.where(first, index, 0).cummax(dim=-1).values)
        kept = strictly_above < top_p * total[pending]
        # the last kept candidate (the top one always is): its logit is the threshold
        last = kept.sum(-1, keepdim=True).clamp(min=1) - 1
        done = ~kept.all(-1) if count < V else torch.ones_like(kept[:, 0])
        tau[pending[done]] = values.gather(-1, last).squeeze(-1)[done]
        pending = pending[~done]
        if pending.numel() == 0:
            break
    return tau


def _row_logits(head, n0, n1, slope=False):
    """The whole rows n0:n1 of the logits, fp32 [n, V] (and dz/du with ``slope``), by ``gemm.mm_fp32``."""
    hidden, weight, _, bias, transform, lora = head
    u = torch.empty((n1 - n0, weight.shape[0]), dtype=torch.float32, device=hidden.device)
    gemm.mm_fp32(hidden[n0:n1], weight.T, u, accumulate=False)
    if lora is not None:
        gemm.mm_fp32(lora[0][n0:n1], lora[1].T, u, accumulate=True)
    if bias is not None:
        u += bias.float()
    return transform.apply(u, slope=slope)


def _nontarget_mass(z, lse, target, kept=None):
    """sum over the row's other (kept) entries of exp(z - lse): 1 - p_y without cancellation."""
    p = torch.exp(z - lse[:, None])
    if kept is not None:
        p = p.masked_fill_(~kept, 0.0)
    return p.scatter_(1, target[:, None], 0.0).sum(-1)


def _rows(head):
    N, V = head.hidden.shape[0], head.weight.shape[0]
    rows = _rows_per_chunk(4 * V, ROW_BUDGET_BYTES)
    return ((n0, min(n0 + rows, N)) for n0 in range(0, N, rows))


def parameter_forward(head: HeadOperands, support: SamplerSupport) -> SupportRecord:
    """Both log-sum-exps of every row of ``head`` under the sampling parameters (module docstring)."""
    N, V = head.hidden.shape[0], head.weight.shape[0]
    record = SupportRecord(*(torch.empty(N, device=head.hidden.device) for _ in SupportRecord._fields))
    for n0, n1 in _rows(head):
        z = _row_logits(head, n0, n1)
        target = head.targets[n0:n1].clamp(0, V - 1)
        tau = kept_threshold(z, support)
        kept = z >= tau[:, None]
        lse = torch.logsumexp(z, dim=-1)
        kept_lse = torch.logsumexp(z.masked_fill(~kept, -math.inf), dim=-1)
        record.target_logit[n0:n1] = z.gather(-1, target[:, None]).squeeze(-1)
        record.kept_lse[n0:n1] = kept_lse
        record.kept_nontarget_mass[n0:n1] = _nontarget_mass(z, kept_lse, target, kept)
        record.threshold[n0:n1] = tau
        record.lse[n0:n1] = lse
        record.nontarget_mass[n0:n1] = _nontarget_mass(z, lse, target)
    return record


def _products(g, like):
    """g (fp32) as the GEMMs read it: in the weight's dtype where cuBLAS multiplies half operands into fp32 (the
    chunked backward's rounding), else fp32."""
    return g.to(like.dtype) if gemm.half_operands_on_cublas(g, like, like) else g


def parameter_backward(head, record, grad_logp, grad_support, grads: HeadGrads):
    """Accumulate both log-probs' gradients (``grad_logp`` = dL/dlogp, ``grad_support`` = dL/ds, [N] fp32; None:
    no gradient) into ``grads`` (fp32 buffers, each None where not wanted): one recompute of each chunk's rows."""
    hidden, weight, targets, _, _, lora = head
    V = weight.shape[0]
    for n0, n1 in _rows(head):
        z, dz_du = _row_logits(head, n0, n1, slope=True)
        target = targets[n0:n1].clamp(0, V - 1)[:, None]
        g = torch.zeros_like(z)
        column = torch.zeros(n1 - n0, device=z.device)
        if grad_logp is not None:
            c = grad_logp[n0:n1]
            g -= torch.exp(z - record.lse[n0:n1, None]) * c[:, None]
            column += c * record.nontarget_mass[n0:n1]
        if grad_support is not None:
            d = grad_support[n0:n1]
            q = torch.exp(z - record.kept_lse[n0:n1, None]).masked_fill_(z < record.threshold[n0:n1, None], 0.0)
            g -= q * d[:, None]
            column += d * record.kept_nontarget_mass[n0:n1]
        g.scatter_(1, target, column[:, None])
        g.mul_(dz_du)
        a = _products(g, weight)
        if grads.hidden is not None:
            gemm.mm_fp32(a, weight, grads.hidden[n0:n1], accumulate=True)
        if grads.weight is not None:
            gemm.mm_fp32(a.T, hidden[n0:n1], grads.weight, accumulate=True)
        if grads.bias is not None:
            grads.bias.add_(g.sum(0))
        if lora is not None and grads.lora_hidden is not None:
            gemm.mm_fp32(_products(g, lora[1]), lora[1], grads.lora_hidden[n0:n1], accumulate=True)
        if lora is not None and grads.lora_weight is not None:
            gemm.mm_fp32(_products(g, lora[0]).T, lora[0][n0:n1], grads.lora_weight, accumulate=True)


class KeptDots(NamedTuple):
    """The three products of replayed kept sets (``kernels.kept_set``'s contract): ``logits(x, y, ids, out)`` adds
    x[n] . y[ids[n, j]] into out [N, K]; ``grad_rows(g, y, ids, out)`` adds sum_j g[n, j] y[ids[n, j]] into out
    [N, E]; ``grad_table(g, x, ids, out)`` adds g[n, j] x[n] into out[ids[n, j]]. fp32 out, -1 ids off."""

    logits: Callable
    grad_rows: Callable
    grad_table: Callable


def _gathered(y, ids, n0, n1):
    return y[ids[n0:n1].clamp(min=0)].float(), (ids[n0:n1] >= 0)


def _chunks(ids, width):
    N, K = ids.shape
    rows = _rows_per_chunk(4 * K * width, GATHER_BUDGET_BYTES)
    return ((n0, min(n0 + rows, N)) for n0 in range(0, N, rows))


def _torch_logits(x, y, ids, out):
    for n0, n1 in _chunks(ids, y.shape[1]):
        rows, valid = _gathered(y, ids, n0, n1)
        out[n0:n1] += torch.einsum("ne,nke->nk", x[n0:n1].float(), rows) * valid
    return out


def _torch_grad_rows(g, y, ids, out):
    for n0, n1 in _chunks(ids, y.shape[1]):
        rows, valid = _gathered(y, ids, n0, n1)
        out[n0:n1] += torch.einsum("nk,nke->ne", g[n0:n1] * valid, rows)
    return out


def _torch_grad_table(g, x, ids, out):
    for n0, n1 in _chunks(ids, x.shape[1]):
        valid = ids[n0:n1] >= 0
        terms = (g[n0:n1] * valid)[:, :, None] * x[n0:n1].float()[:, None, :]
        out.index_add_(0, ids[n0:n1].clamp(min=0).reshape(-1), terms.reshape(-1, x.shape[1]))
    return out


TORCH_DOTS = KeptDots(_torch_logits, _torch_grad_rows, _torch_grad_table)


def _kept_logits(head, kept_ids, dots, slope=False):
    """The logits of every row's kept entries, fp32 [N, K] (-inf in the filling), and dz/du with ``slope``."""
    hidden, weight, _, bias, transform, lora = head
    u = torch.zeros(kept_ids.shape, dtype=torch.float32, device=hidden.device)
    dots.logits(hidden, weight, kept_ids, u)
    if lora is not None:
        dots.logits(lora[0], lora[1], kept_ids, u)
    if bias is not None:
        u += bias.float()[kept_ids.clamp(min=0)]
    z, dz_du = transform.apply(u, slope=True)
    z = z.masked_fill(kept_ids < 0, -math.inf)
    return (z, dz_du) if slope else z


def replayed_forward(head, kept_ids, dots=TORCH_DOTS):
    """The support's record with replayed kept sets (``kept_ids`` [N, K] int64), their logits by ``dots``."""
    z = _kept_logits(head, kept_ids, dots)
    at_target = kept_ids == head.targets[:, None]
    # the target's kept entry (-inf where the set lacks it: the caller's check, or NaN support)
    target_logit = z.masked_fill(~at_target, -math.inf).amax(dim=-1)
    kept_lse = torch.logsumexp(z, dim=-1)
    rest = torch.exp(z - kept_lse[:, None]).masked_fill_(at_target, 0.0).sum(-1)  # 1 - q_y, carried
    return SupportRecord(target_logit, kept_lse, rest, *(torch.empty(0, device=z.device) for _ in range(3)))


def replayed_backward(head, kept_ids, record, grad_support, grads, dots=TORCH_DOTS):
    """``backward`` with replayed kept sets: g = dL/du over the kept entries, then ``dots``' gradients."""
    hidden, weight, targets, _, _, lora = head
    z, dz_du = _kept_logits(head, kept_ids, dots, slope=True)
    at_target = kept_ids == targets[:, None]
    q = torch.exp(z - record.kept_lse[:, None])  # 0 in the filling (z = -inf)
    # the target's column d (1 - q_y), carried; the others -d q_v
    g = torch.where(at_target, record.kept_nontarget_mass[:, None], -q).mul_(grad_support[:, None]).mul_(dz_du)
    g = g.masked_fill_(kept_ids < 0, 0.0).contiguous()
    if grads.hidden is not None:
        dots.grad_rows(g, weight, kept_ids, grads.hidden)
    if grads.weight is not None:
        dots.grad_table(g, hidden, kept_ids, grads.weight)
    if grads.bias is not None:
        grads.bias.index_add_(0, kept_ids.clamp(min=0).reshape(-1), g.reshape(-1))
    if grads.lora_hidden is not None:
        dots.grad_rows(g, lora[1], kept_ids, grads.lora_hidden)
    if grads.lora_weight is not None:
        dots.grad_table(g, lora[0], kept_ids, grads.lora_weight)


def forward(head: HeadOperands, support: SamplerSupport, dots: KeptDots = TORCH_DOTS) -> SupportRecord:
    """The support's record of ``head``'s rows: replayed sets' by ``dots``, else the parameters'."""
    if support.kept_ids is not None:
        return replayed_forward(head, support.kept_ids, dots)
    return parameter_forward(head, support)


def backward(head, support, record, grad_logp, grad_support, grads, dots: KeptDots = TORCH_DOTS):
    """The gradients of the log-probs the record's path computed (replayed sets: the support's alone)."""
    if support.kept_ids is not None:
        if grad_support is not None:
            replayed_backward(head, support.kept_ids, record, grad_support, grads, dots)
    else:
        parameter_backward(head, record, grad_logp, grad_support, grads)
