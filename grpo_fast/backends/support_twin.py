"""The sampler's kept set and the log-sum-exp over it (``grpo_fast.sampler_logprobs``' support), in chunked
PyTorch, on any device; both backends run it until the selection has kernels of its own.

Math. The kept set of a row is {v : z_v >= tau} (every rule of ``SamplerSupport`` keeps the largest logits, ties
with the last kept one included), and the support's log-prob of the target y is s = z_y - L with
L = log sum_{z_v >= tau} exp(z_v). Its gradient: ds/dz_v = [v = y] - [z_v >= tau] exp(z_v - L), tau held fixed
(the set is piecewise constant in the logits).

Two ways to the kept set:
* the sampling parameters (``kept_threshold``): each chunk of token rows holds its whole rows of logits (fp32,
  [rows, V]; rows from a byte budget, so the buffer does not grow with the tokens) and applies the rules in vLLM's
  order, min-p on p / max p = exp(z - max z), top-k on the k-th largest survivor (``topk``), top-p on the
  survivors' masses sorted and summed in fp64 from the top, over each row's largest 64 logits where the cut lies
  among them, else 1024, else the whole row; the backward recomputes the rows (one more GEMM sweep each way);
* the replayed sets (``kept_ids`` [N, K], -1 filling): the logits of the K kept entries alone, a gather of K weight
  rows a token (O(N K D) work, no vocabulary sweep), and in the backward dH = g W_kept, dW and db scattered into the
  kept rows.
"""

from __future__ import annotations

import math

import torch

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


def _row_logits(head, n0, n1, slope=False):
    """The whole rows n0:n1 of the logits, fp32 [n, V] (and dz/du with ``slope``)."""
    hidden, weight, _, bias, transform, lora = head
    u = hidden[n0:n1].float() @ weight.float().T
    if lora is not None:
        u += lora[0][n0:n1].float() @ lora[1].float().T
    if bias is not None:
        u += bias.float()
    return transform.apply(u, slope=slope)


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


def forward(head: HeadOperands, support: SamplerSupport) -> SupportRecord:
    """The support's record of every row of ``head`` (module docstring)."""
    if support.kept_ids is not None:
        return _replayed_forward(head, support.kept_ids)
    hidden, weight, targets = head.hidden, head.weight, head.targets
    N, V = hidden.shape[0], weight.shape[0]
    rows = _rows_per_chunk(4 * V, ROW_BUDGET_BYTES)
    target_logit, kept_lse, threshold = (torch.empty(N, device=hidden.device) for _ in range(3))
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        z = _row_logits(head, n0, n1)
        tau = kept_threshold(z, support)
        kept = z.masked_fill(z < tau[:, None], -math.inf)
        threshold[n0:n1] = tau
        kept_lse[n0:n1] = torch.logsumexp(kept, dim=-1)
        target_logit[n0:n1] = z.gather(-1, targets[n0:n1, None].clamp(0, V - 1)).squeeze(-1)
    return SupportRecord(target_logit, kept_lse, threshold)


def backward(head: HeadOperands, support: SamplerSupport, record: SupportRecord, grad_support, grads: HeadGrads):
    """Accumulate the support log-prob's gradients (``grad_support`` = dL/ds [N]) into ``grads`` (fp32 buffers, each
    None where not wanted), as ``head_twin.backward`` does for the log-prob."""
    if support.kept_ids is not None:
        return _replayed_backward(head, support.kept_ids, record, grad_support, grads)
    from grpo_fast.backends.head_twin import add_tile_gradients

    hidden, weight, targets, _, _, lora = head
    N, V = hidden.shape[0], weight.shape[0]
    rows = _rows_per_chunk(4 * V, ROW_BUDGET_BYTES)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        c = grad_support[n0:n1]
        if not bool((c != 0).any()):
            continue  # rows without a gradient (masked): exactly zero
        z, dz_du = _row_logits(head, n0, n1, slope=True)
        p = torch.exp(z - record.kept_lse[n0:n1, None]).masked_fill_(z < record.threshold[n0:n1, None], 0.0)
        g = p.mul_(-c[:, None])
        g.scatter_add_(1, targets[n0:n1, None].clamp(0, V - 1), c[:, None])
        g.mul_(dz_du)
        add_tile_gradients(g, hidden[n0:n1], weight, slice(n0, n1), slice(0, V), grads.hidden, grads.weight, grads.bias)
        if grads.lora_hidden is not None:
            grads.lora_hidden[n0:n1] += g @ lora[1].float()
        if grads.lora_weight is not None:
            grads.lora_weight.add_(g.T @ lora[0][n0:n1].float())
    return None


def _kept_logits(head, kept_ids, n0, n1, slope=False):
    """The logits of the kept entries of rows n0:n1, fp32 [n, K] (-inf in the filling), and the gathered weight
    rows [n, K, D] (fp32), LoRA rows [n, K, r] or None, the kept ids clamped to >= 0 and their validity."""
    hidden, weight, _, bias, transform, lora = head
    ids = kept_ids[n0:n1]
    valid = ids >= 0
    safe = ids.clamp(min=0)
    rows = weight[safe].float()
    u = torch.einsum("nd,nkd->nk", hidden[n0:n1].float(), rows)
    lora_rows = None
    if lora is not None:
        lora_rows = lora[1][safe].float()
        u += torch.einsum("nr,nkr->nk", lora[0][n0:n1].float(), lora_rows)
    if bias is not None:
        u += bias[safe].float()
    z = transform.apply(u, slope=slope)
    if slope:
        z, dz_du = z
    z = z.masked_fill(~valid, -math.inf)
    return (z, dz_du if slope else None), rows, lora_rows, safe, valid


def _replayed_forward(head, kept_ids):
    hidden, targets = head.hidden, head.targets
    N, K, D = hidden.shape[0], kept_ids.shape[1], hidden.shape[1]
    rows = _rows_per_chunk(4 * K * D, GATHER_BUDGET_BYTES)
    target_logit, kept_lse = torch.empty(N, device=hidden.device), torch.empty(N, device=hidden.device)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        (z, _), *_ = _kept_logits(head, kept_ids, n0, n1)
        kept_lse[n0:n1] = torch.logsumexp(z, dim=-1)
        at_target = kept_ids[n0:n1] == targets[n0:n1, None]
        # the target's kept entry (-inf where the set lacks it: the caller's check, or NaN support)
        target_logit[n0:n1] = z.masked_fill(~at_target, -math.inf).amax(dim=-1)
    return SupportRecord(target_logit, kept_lse, torch.empty(0, device=hidden.device))


def _replayed_backward(head, kept_ids, record, grad_support, grads):
    hidden, weight, targets, _, _, lora = head
    N, K, D = hidden.shape[0], kept_ids.shape[1], hidden.shape[1]
    rows = _rows_per_chunk(4 * K * D, GATHER_BUDGET_BYTES)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        c = grad_support[n0:n1]
        if not bool((c != 0).any()):
            continue
        (z, dz_du), w_rows, lora_rows, safe, valid = _kept_logits(head, kept_ids, n0, n1, slope=True)
        p = torch.exp(z - record.kept_lse[n0:n1, None]).masked_fill_(~valid, 0.0)
        g = (kept_ids[n0:n1] == targets[n0:n1, None]).float().sub_(p).mul_(c[:, None]).mul_(dz_du)
        g = g.masked_fill_(~valid, 0.0)
        flat_ids, flat_g = safe[valid], g[valid]
        if grads.hidden is not None:
            grads.hidden[n0:n1] += torch.einsum("nk,nkd->nd", g, w_rows)
        if grads.weight is not None:
            h = hidden[n0:n1].float()
            grads.weight.index_add_(0, flat_ids, (g[:, :, None] * h[:, None, :])[valid])
        if grads.bias is not None:
            grads.bias.index_add_(0, flat_ids, flat_g)
        if grads.lora_hidden is not None:
            grads.lora_hidden[n0:n1] += torch.einsum("nk,nkr->nr", g, lora_rows)
        if grads.lora_weight is not None:
            grads.lora_weight.index_add_(0, flat_ids, (g[:, :, None] * lora[0][n0:n1].float()[:, None, :])[valid])
    return None
