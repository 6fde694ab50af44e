"""The sampler's kept set and the log-sum-exps over it and over the vocabulary (``grpo_fast.sampler_logprobs``),
in chunked PyTorch on any device: the rows of logits, the selection and the backward that both backends share, and
the replayed sets' path (whose products the Triton backend fills with ``kernels.kept_set``).

Math. The kept set of a row is {v : z_v >= tau} (every rule of ``SamplerSupport`` keeps the largest logits, ties with
the last kept one included); the support's log-prob of the target y is s = z_y - L, L = log sum_{z_v >= tau}
exp(z_v), the log-prob logp = z_y - lse. Gradients (tau held fixed: the set is piecewise constant in the logits):
dz_v = c [v = y] - c p_v + d [v = y] - d [z_v >= tau] q_v, with c = dL/dlogp, d = dL/ds, p = exp(z - lse), q =
exp(z - L); the target's column is c (1 - p_y) + d (1 - q_y), both carried from the forward as sums over the other
entries, never formed by cancellation (a confident token's gradient exact relative to its size).

Two ways to the kept set:
* the sampling parameters (``support_rows.parameter_forward``, over this module's rows and selection): each chunk of
  token rows holds its whole rows of logits in fp32 ([rows, V], rows from a byte budget, a multiple of
  ``gemm.token_gemm_rows`` where it holds one: the buffer does not grow with the tokens), written by
  ``gemm.mm_token_rows`` (cuBLAS with an fp32 output from bf16 operands on a GPU, in blocks of token rows: a row's
  logits whatever N). The selection here (``kept_threshold``) applies the rules in vLLM's order: min-p on
  p / max p = exp(z - max z), top-k on the k-th largest survivor (``topk``), top-p on the survivors' masses sorted
  and summed in fp64 from the top, over each row's largest 64 logits where the cut lies among them, else 1024, else
  the whole row (a vocab-parallel shard: a bisection). One GEMM sweep forward for both outputs, one recompute in the
  backward for both gradients (``parameter_backward``: then dH = g W and dW = g^T H, two more). The Triton backend's
  one-process path (``support_tiles``) takes the log-prob's record sweep instead, and with gradients carries the kept
  ids to a backward of gathers (``replayed_backward``'s);
* the replayed sets (``replayed_forward``, ``kept_ids`` [N, K], -1 filling): the logits of the K kept entries alone
  (``KeptDots``: a gather of K weight rows a token, O(N K D), no vocabulary sweep), the log-prob left to layer 1's
  own op; without gradients (one process) the op computes the log-prob too (``with_logprob``: the Triton backend's
  sets from one record sweep that reads their bitmaps, ``kernels.forward.kept_record``), and on the Triton backend
  with a trained head too (``Backend.replayed_takes_logprob``: its backward layer 1's with the support's term).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_fast.kernels import gemm, softmax_stats
from grpo_fast.kernels.operands import HeadGrads, SamplerSupport, SupportRecord, no_kept_ids

# the fp32 bytes of one chunk's logit rows (and as much again for the temporaries): at V = 152k, 220 rows a chunk
ROW_BUDGET_BYTES = 1 << 27
# top-p's candidates a row: its largest 64 logits hold top_p of the mass in most rows of a language model; the
# rows where they do not try 1024, then the whole row sorted
CANDIDATES = (64, 1024)
# the bytes of one chunk's gathered kept weight rows ([rows, K, D] fp32)
GATHER_BUDGET_BYTES = 1 << 26


def _rows_per_chunk(bytes_per_row, budget):
    return max(1, budget // max(1, bytes_per_row))


class OneProcess:
    """The reduce steps of a whole head (every entry on this process): identities. A vocab-parallel head's
    (``grpo_fast.sampler.vocab_parallel``) reduce over its group: [n] maxima, minima and sums, candidates gathered
    along the last dimension; ``complete_rows``: whether a row's whole logits may be gathered (else top-p's last
    resort is a bisection whose traffic grows with the tokens only)."""

    complete_rows = True

    def max(self, x):
        return x

    def min(self, x):
        return x

    def sum(self, x):
        return x

    def gather(self, x):
        return x


ONE_PROCESS = OneProcess()


def _largest(z, count):
    """[n, count] each row's largest ``count`` logits, descending, padded with -inf past a shard's rows (every rank
    gathers the same shape)."""
    values = z.topk(min(count, z.shape[-1]), dim=-1).values
    if values.shape[-1] < count:
        values = torch.cat([values, values.new_full((z.shape[0], count - values.shape[-1]), -math.inf)], dim=-1)
    return values


def _row_max(z):
    """[n] the rows' largest logits (-inf for a shard without rows)."""
    return z.amax(dim=-1) if z.shape[-1] else z.new_full(z.shape[:1], -math.inf)


def kept_threshold(z, support: SamplerSupport, top, vocab_size, reduce=ONE_PROCESS):
    """tau [n] fp32 of rows of logits ``z`` [n, V_local] under the sampling parameters (module docstring): the
    smallest kept logit; the kept set is {v : z_v >= tau}. ``top`` [n]: the rows' largest logits (over every
    shard); ``vocab_size``: the whole head's rows."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if support.min_p > 0:
        keep &= torch.exp(z - top[:, None]) >= support.min_p  # p_v / max p, in vLLM's fp32 softmax's terms
    if 0 < support.top_k < vocab_size:
        local = _largest(z.masked_fill(~keep, -math.inf), support.top_k)
        kth = reduce.gather(local).topk(support.top_k, dim=-1).values[:, -1:]
        keep &= z >= kth
    if support.top_p < 1:
        return _top_p_threshold(z.masked_fill(~keep, -math.inf), top, support.top_p, reduce)
    return reduce.min(torch.where(keep, z, math.inf).amin(dim=-1) if z.shape[-1] else top.new_full(top.shape, math.inf))


def _strictly_above(values, top):
    """The survivors' mass (fp64, unnormalised) ranked strictly above each entry of rows ``values`` sorted
    descending: an entry tied with the one before it has its tie group's first entry's."""
    return mass_strictly_above(values, torch.exp(values - top[:, None]).double())


def mass_strictly_above(values, mass):
    """``_strictly_above`` of rows ``values`` sorted descending whose entries carry ``mass`` (fp64) each."""
    above = mass.cumsum(-1) - mass
    first = torch.ones_like(values, dtype=torch.bool)
    first[:, 1:] = values[:, 1:] != values[:, :-1]
    index = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    return above.gather(-1, torch.where(first, index, 0).cummax(dim=-1).values)


def _top_p_threshold(z, top, top_p, reduce):
    """tau of top-p over the survivors z (-inf: removed) of rows whose largest logit is ``top``.

    Candidates: each row's largest CANDIDATES[i] logits on every shard, merged. Every entry above the largest
    shard's last candidate f is a candidate, so once some candidate at or above f falls out of the kept set, the
    cut lies among the candidates and tau is the last kept one. Rows it does not resolve try the next count; then
    the whole row where it is in hand (``reduce.complete_rows``), else ``_bisected_threshold``."""
    V = z.shape[-1]
    total = reduce.sum(torch.exp(z - top[:, None]).double().sum(-1))
    tau = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    pending = torch.arange(z.shape[0], device=z.device)
    counts = CANDIDATES + ((V,) if reduce.complete_rows else ())
    for count in counts:
        rows = z[pending]
        local = _largest(rows, min(count, V) if reduce.complete_rows else count)
        floor = reduce.max(local[:, -1] if V > count else rows.new_full(rows.shape[:1], -math.inf))
        values = reduce.gather(local).sort(dim=-1, descending=True).values
        kept = _strictly_above(values, top[pending]) < top_p * total[pending, None]
        resolved = ((~kept) & (values >= floor[:, None])).any(-1) | (floor == -math.inf)
        last = kept.sum(-1, keepdim=True).clamp(min=1) - 1  # the top candidate is always kept
        tau[pending[resolved]] = values.gather(-1, last).squeeze(-1)[resolved]
        pending = pending[~resolved]
        if pending.numel() == 0:
            return tau
    tau[pending] = _bisected_threshold(z[pending], top[pending], top_p * total[pending], reduce)
    return tau


def _order_keys(z):
    """int64 keys ordered as z's fp32 values (the sign bit's flip for negative ones)."""
    bits = z.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _bisected_threshold(z, top, bound, reduce):
    """tau of top-p by bisection over fp32's ordered keys: the least key x whose mass strictly above, summed over
    the shards, is below ``bound`` (= top_p times the survivors' mass), then the least logit at or above it. 33
    steps of one all-reduce of [n] each: the traffic grows with the tokens, never with the vocabulary."""
    keys = _order_keys(z)
    mass = torch.exp(z - top[:, None]).double()
    low = torch.full_like(top, -(2**31) - 1, dtype=torch.int64)  # below every key: the whole mass above it
    high = _order_keys(top)  # no mass strictly above the top logit
    for _ in range(33):
        middle = (low + high) // 2
        above = reduce.sum(torch.where(keys > middle[:, None], mass, 0.0).sum(-1))
        low, high = torch.where(above < bound, low, middle), torch.where(above < bound, middle, high)
    return reduce.min(torch.where(keys >= high[:, None], z, math.inf).amin(dim=-1))


def _row_logits(head, n0, n1, slope=False):
    """The whole rows n0:n1 of the logits, fp32 [n, V] (and dz/du with ``slope``), by ``gemm.mm_token_rows`` (its
    last block's padding rows in the buffer's own)."""
    hidden, weight, _, bias, transform, lora = head
    n = n1 - n0
    u = torch.empty((gemm.padded_rows(n, hidden.device), weight.shape[0]), dtype=torch.float32, device=hidden.device)
    if weight.shape[0]:
        gemm.mm_token_rows(hidden[n0:n1], weight.T, u, accumulate=False, rows=n)
        if lora is not None:
            gemm.mm_token_rows(lora[0][n0:n1], lora[1].T, u, accumulate=True, rows=n)
    u = u[:n]
    if bias is not None:
        u += bias.float()
    return transform.apply(u, slope=slope)


def _rows(head):
    """The chunks (n0, n1) of the parameters' path: the budget's rows, a multiple of the token-row GEMM's block
    where the budget holds one (only a call's last chunk then pads a block; a smaller budget pads every chunk)."""
    N, V = head.hidden.shape[0], head.weight.shape[0]
    rows = _rows_per_chunk(4 * max(V, 1), ROW_BUDGET_BYTES)
    block = gemm.token_gemm_rows(head.hidden.device)
    if rows >= block:
        rows -= rows % block
    return ((n0, min(n0 + rows, N)) for n0 in range(0, N, rows))


def _products(g, like):
    """g (fp32) as the GEMMs read it: in the weight's dtype where cuBLAS multiplies half operands into fp32 (the
    chunked backward's rounding), else fp32."""
    return g.to(like.dtype) if gemm.half_operands_on_cublas(g, like, like) else g


def parameter_backward(head, record, grad_logp, grad_support, grads: HeadGrads):
    """Accumulate both log-probs' gradients (``grad_logp`` = dL/dlogp, ``grad_support`` = dL/ds, [N] fp32; None:
    no gradient) into ``grads`` (fp32 buffers, each None where not wanted): one recompute of each chunk's rows. A
    shard's: its rows' dW and db, its part of dH (the caller sums dH over the group)."""
    hidden, weight, targets, _, _, lora = head
    V = weight.shape[0]
    if V == 0:  # a shard without rows: no gradient of its own
        return
    for n0, n1 in _rows(head):
        n = n1 - n0
        z, dz_du = _row_logits(head, n0, n1, slope=True)
        owned = ((targets[n0:n1] >= 0) & (targets[n0:n1] < V))[:, None]
        target = targets[n0:n1].clamp(0, V - 1)[:, None]
        # g with the last block's padding rows (zero) for dH's blocks of token rows (gemm.mm_token_rows)
        g_rows = torch.zeros((gemm.padded_rows(n, z.device), V), dtype=z.dtype, device=z.device)
        g = g_rows[:n]
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
        # the target's column, carried, where this shard holds the target
        g.scatter_(1, target, torch.where(owned, column[:, None], g.gather(1, target)))
        g.mul_(dz_du)
        a = _products(g_rows, weight)
        if grads.hidden is not None:
            gemm.mm_token_rows(a, weight, grads.hidden[n0:n1], accumulate=True, rows=n)
        if grads.weight is not None:  # the vocabulary's rows: a sum over the tokens, one call
            gemm.mm_fp32(a[:n].T, hidden[n0:n1], grads.weight, accumulate=True)
        if grads.bias is not None:
            grads.bias.add_(g.sum(0))
        if lora is not None and grads.lora_hidden is not None:
            gemm.mm_token_rows(_products(g_rows, lora[1]), lora[1], grads.lora_hidden[n0:n1], accumulate=True, rows=n)
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


def kept_logits(head, kept_ids, dots=TORCH_DOTS, slope=False):
    """The logits z of every row's entries ``kept_ids`` [N, K] (int64, -1: none), fp32 [N, K] (-inf at -1), and with
    ``slope`` dz/du (u: the raw logit; the transform's derivative), by ``dots``."""
    hidden, weight, _, bias, transform, lora = head
    u = torch.zeros(kept_ids.shape, dtype=torch.float32, device=hidden.device)
    if weight.shape[0] == 0:  # a shard without rows: none of the kept entries here
        z = u.fill_(-math.inf)
        return (z, 1.0) if slope else z
    dots.logits(hidden, weight, kept_ids, u)
    if lora is not None:
        dots.logits(lora[0], lora[1], kept_ids, u)
    if bias is not None:
        u += bias.float()[kept_ids.clamp(min=0)]
    z, dz_du = transform.apply(u, slope=True)
    z = z.masked_fill(kept_ids < 0, -math.inf)
    return (z, dz_du) if slope else z


def kept_backward(head, kept_ids, grad_logits, grads: HeadGrads, dots=TORCH_DOTS, slope=None, owned=False):
    """Accumulate the gradients of the logits at ``kept_ids`` [N, K] into ``grads``: ``grad_logits`` [N, K] fp32 is
    dL/dz there (ignored at -1), times dz/du (``slope``: ``kept_logits``' where the caller has it; else the transform's
    constant, or recomputed by a gather with a soft-cap),
    by ``dots``. ``owned``: the caller's temporary, scaled in place (no second [N, K] buffer)."""
    hidden, weight, _, _, _, lora = head
    if weight.shape[0] == 0:  # a shard without rows: no gradient of its own
        return
    if slope is None and head.transform.softcap is None:  # dz/du a constant: no gather to recompute u
        slope = head.transform.apply(grad_logits.new_zeros(()), slope=True)[1]
    dz_du = slope if slope is not None else kept_logits(head, kept_ids, dots, slope=True)[1]
    g = grad_logits.mul_(dz_du) if owned else grad_logits * dz_du
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


def check_no_lora(head):
    """``kept_logits_and_rows`` sums the weight's rows alone: LoRA's would be left out."""
    if head.lora is not None:
        raise ValueError("the gathered logits' row sums take no LoRA (the served loss's fused path runs without it)")


def kept_logits_and_rows(head, kept_ids, weights, dots=TORCH_DOTS):
    """(z [N, K] (-inf at -1), dz/du [N, K], pivot [N], P [N, D], T [N, D]), fp32: the logits at ``kept_ids``, the
    row's largest of them (0 where none), P = sum_k exp(z_k - pivot) dz_k/du_k W[k] and T = sum_k weights_k
    dz_k/du_k W[k] (``weights`` [N, K] fp32), by ``dots``: the logits' gather and one a sum (the Triton backend's
    ``kernels.kept_set.kept_dot_rows`` reads each row once for all three)."""
    check_no_lora(head)
    weight = head.weight
    z, dz_du = kept_logits(head, kept_ids, dots, slope=True)
    dz_du = torch.broadcast_to(torch.as_tensor(dz_du, dtype=torch.float32, device=z.device), z.shape)
    live = kept_ids >= 0
    pivot = _row_max(z)
    pivot = torch.where(pivot == -math.inf, 0.0, pivot)
    sums = []
    for w in (torch.exp(z - pivot[:, None]), weights):
        out = torch.zeros((z.shape[0], weight.shape[1]), dtype=torch.float32, device=z.device)
        if weight.shape[0]:
            dots.grad_rows((w * dz_du).masked_fill_(~live, 0.0).contiguous(), weight, kept_ids, out)
        sums.append(out)
    return z, dz_du.contiguous(), pivot, *sums


def replayed_forward(head, kept_ids, dots=TORCH_DOTS, reduce=ONE_PROCESS):
    """The support's record with replayed kept sets (``kept_ids`` [N, K] int64, this shard's columns: -1 where
    another shard's or no entry), their logits by ``dots``."""
    z = kept_logits(head, kept_ids, dots)
    at_target = (kept_ids == head.targets[:, None]) & (kept_ids >= 0)
    # the target's kept entry (-inf where no set holds it: the caller's check, or NaN support)
    target_logit = reduce.max(z.masked_fill(~at_target, -math.inf).amax(dim=-1))
    top = reduce.max(_row_max(z))
    top = torch.where(top == -math.inf, 0.0, top)  # a row without kept entries: empty sums, not NaN
    e = torch.exp(z - top[:, None])
    total, rest = reduce.sum(torch.stack([e.sum(-1), e.masked_fill(at_target, 0.0).sum(-1)])).unbind(0)
    kept_lse = top + torch.log(total)
    empty = [torch.empty(0, device=z.device) for _ in range(4)]
    return SupportRecord(target_logit, kept_lse, rest / total, *empty, no_kept_ids(z.device))


def takes_logprob(differentiable: bool, reduce) -> bool:
    """Whether a replayed set's forward gives the log-prob too (``with_logprob``): without gradients, on one process
    (``sampler.ops.computes_logprob`` gives the op's shapes alike)."""
    return not differentiable and reduce is ONE_PROCESS


def with_logprob(record: SupportRecord, layer1: softmax_stats.SoftmaxStats) -> SupportRecord:
    """A replayed set's record (``replayed_forward``'s fields) completed without gradients by layer 1's record of the
    same rows (``softmax_stats``, merged): lse, nontarget_mass and layer 1's log-prob itself, finished as layer 1
    finishes it (exact where the token is confident), whether or not the set holds the target."""
    logp, _, stats = softmax_stats.finish(layer1, False)
    return record._replace(logprob=logp, lse=stats.lse, nontarget_mass=stats.nontarget_mass)


def replayed_backward(head, kept_ids, record, grad_support, grads, dots=TORCH_DOTS):
    """``backward`` with replayed kept sets: dL/dz over the kept entries, then ``kept_backward``."""
    if head.weight.shape[0] == 0:  # a shard without rows: no gradient of its own
        return
    z, dz_du = kept_logits(head, kept_ids, dots, slope=True)
    at_target = (kept_ids == head.targets[:, None]) & (kept_ids >= 0)
    q = torch.exp(z - record.kept_lse[:, None])  # 0 in the filling (z = -inf)
    # the target's column d (1 - q_y), carried; the others -d q_v
    grad_logits = torch.where(at_target, record.kept_nontarget_mass[:, None], -q).mul_(grad_support[:, None])
    kept_backward(head, kept_ids, grad_logits, grads, dots, dz_du, owned=True)


def backward(head, support, record, grad_logp, grad_support, grads, dots: KeptDots = TORCH_DOTS):
    """The gradients of the log-probs the record's path computed (replayed sets: the support's alone)."""
    if support.kept_ids is not None:
        if grad_support is not None:
            replayed_backward(head, support.kept_ids, record, grad_support, grads, dots)
    else:
        parameter_backward(head, record, grad_logp, grad_support, grads)
