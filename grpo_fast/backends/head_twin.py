"""Layer 1's torch twin, the "torch" backend: the kernels' algorithm in chunked PyTorch, for any torch device (a
laptop's CPU, a GPU without Triton).

Same math as ``kernels.forward`` and ``kernels.backward`` (``kernels.tile`` has the gradient,
``transform.LogitTransform.apply`` the transform): the logits exist one [CHUNK_N, CHUNK_V] fp32 tile at a time; each
vocabulary chunk's per-token record (``softmax_stats.SoftmaxStats``: max, sum of exp, the non-target sum, the
relative z-sum, the target logit) is folded into the running one with ``softmax_stats.merge``, and
``softmax_stats.finish`` gives the outputs and what the backward reads. The backward recomputes each tile to form g
(every non-target column from p = exp(z - lse); the target column from the carried 1 - p_y and mean - z_y, never by
cancellation) and accumulates dH, dW, db. Peak extra memory: one tile and a few same-sized temporaries (fp32), plus
fp32 dH / dW accumulators; never N x V.

LoRA on the head (``lora.HeadLora``): ``lora`` = (lora_hidden [N, r], lora_weight [V, r]) adds lora_hidden
lora_weight^T to each tile's raw logits (fp32), and the backward adds d lora_hidden = g lora_weight and
d lora_weight = g^T lora_hidden (fp32 accumulators).

The frozen head (``kernels.forward_frozen``'s math): ``forward_frozen_head`` also accumulates J = d logp / dh online
with the record, so that the backward is dH = grad_logp J: two vocabulary GEMMs in all instead of three.

Batch invariance (docs/batch-invariance.md): every product whose rows are tokens (the logits, J's accumulator, dH,
LoRA's alike) runs in blocks of ``gemm.TOKEN_GEMM_ROWS`` rows (``gemm.mm_token_rows``), so a token's values do not
depend on how many tokens share its chunk; CHUNK_N is a multiple of every device's block (only a call's last block
pads). The vocabulary's products (dW = g^T H) sum over tokens and stay one call a tile.
"""

import torch

from grpo_fast.kernels import softmax_stats
from grpo_fast.kernels.gemm import mm_token_rows, padded_rows
from grpo_fast.kernels.softmax_stats import SoftmaxStats

CHUNK_N = 1024
CHUNK_V = 8192


def _logit_tile(head, n0, n1, v0, v1, slope=False):
    """z = transform(h W^T + l B^T + b) for one tile of ``head``'s logits, fp32 (l B^T: LoRA's pair, if any); with
    ``slope`` also dz/du (a tile, or a number without a soft-cap)."""
    hidden, weight, _, bias, transform, lora = head
    # in blocks of token rows (gemm.mm_token_rows), u holding the last block's padding rows
    u = torch.empty((padded_rows(n1 - n0, hidden.device), v1 - v0), dtype=torch.float32, device=hidden.device)
    mm_token_rows(hidden[n0:n1].float(), weight[v0:v1].float().T, u, accumulate=False, rows=n1 - n0)
    if lora is not None:
        mm_token_rows(lora[0][n0:n1].float(), lora[1][v0:v1].float().T, u, accumulate=True, rows=n1 - n0)
    u = u[: n1 - n0]
    if bias is not None:
        u += bias[v0:v1].float()
    return transform.apply(u, slope=slope)


def forward(head, compute_entropy):
    """An operands.HeadOperands (hidden [N, D], weight [V, D], targets [N], bias, transform, lora) -> (logp, entropy,
    softmax_stats.BackwardStats), [N] fp32 each; entropy (and the backward's entropy values) None without
    ``compute_entropy``.
    """
    return softmax_stats.finish(forward_record(head, compute_entropy), compute_entropy)


def forward_record(head, compute_entropy):
    """The unfinished per-token record (softmax_stats.SoftmaxStats, [N] fp32 fields) of these weight rows, which
    ``forward`` finishes; zsum is 0 without ``compute_entropy``. No rows (V = 0): the empty record."""
    return _forward(head, compute_entropy, frozen_head=False)[0]


def forward_frozen_head(head, compute_entropy=True):
    """The frozen-head forward: ``forward``'s (logp, entropy, BackwardStats), J = d logp / d hidden [N, D] fp32 and,
    with LoRA, J_l = d logp / d lora_hidden [N, r] fp32 (else None).

    For a weight and bias that need no gradient and an entropy that needs none: the backward is then
    dH = grad_logp[:, None] * J, with no recompute and no third vocabulary GEMM (``kernels.forward_frozen`` has the
    math). J is accumulated in fp32 with the record, rescaled whenever the running max moves; memory: J (N x D
    fp32) besides forward's tile. The outputs are bit for bit ``forward``'s.
    """
    stats, acc, target_slope, lora_acc = forward_frozen_record(head, compute_entropy)
    grad = softmax_stats.finish_frozen_grad(acc, stats, target_slope, head.weight, head.targets)
    if head.lora is not None:
        lora_acc = softmax_stats.finish_frozen_grad(lora_acc, stats, target_slope, head.lora[1], head.targets)
    return (*softmax_stats.finish(stats, compute_entropy), grad, lora_acc)


def forward_frozen_record(head, compute_entropy=True):
    """The frozen-head forward up to "finish": (record, acc, target_slope, lora_acc), unfinished, for
    softmax_stats.finish_frozen_grad (J) and softmax_stats.finish (the outputs), or for a caller that merges them with
    other rows' first (a vocab-parallel head's shards). acc [N, D] fp32 = sum_{v != y} exp(z_v - m) s'_v W_v against
    the record's max m; target_slope [N] = s'_y (the transform's constant slope without a soft-cap); lora_acc
    [N, r] fp32 the same sum over lora_weight's rows (None without LoRA)."""
    return _forward(head, compute_entropy, frozen_head=True)


def _forward(head, compute_entropy, frozen_head):
    """(record, acc or None, target slope or None, lora acc or None): the online record over vocab chunks, and with
    ``frozen_head`` the online acc = sum_{v != y} exp(z_v - m) s'_v W_v (s' = dz/du, m the running max; the same over
    lora_weight with LoRA) and s'_y: the target's own term is kept out of the running sum, to be weighted by the
    other entries' sum when J is finished, so that 1 - p_y is never formed by cancellation."""
    hidden, weight, targets, bias, transform, lora = head
    N, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    records = []
    grad = torch.empty((N, hidden.shape[1]), dtype=torch.float32, device=dev) if frozen_head else None
    lora_grad = (
        torch.empty((N, lora[1].shape[1]), dtype=torch.float32, device=dev)
        if frozen_head and lora is not None
        else None
    )
    slopes = torch.zeros(N, device=dev) if frozen_head else None
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        tgt = targets[n0:n1]
        empty = torch.zeros(n1 - n0, device=dev)
        run = SoftmaxStats(torch.full((n1 - n0,), float("-inf"), device=dev), empty, empty, empty, empty)
        if frozen_head:
            acc = grad[n0:n1].zero_()  # sum_{v != y} exp(z_v - m) s'_v W_v, rescaled with the running max m
            lora_acc = lora_grad[n0:n1].zero_() if lora is not None else None
            target_slope = slopes[n0:n1]
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            z, dz_du = _logit_tile(head, n0, n1, v0, v1, slope=True)
            chunk, e = softmax_stats.record(z, tgt - v0, compute_entropy)
            if frozen_head:
                new_pivot = torch.maximum(run.max, chunk.max)
                new_pivot = torch.where(torch.isinf(new_pivot), torch.zeros_like(new_pivot), new_pivot)
                if torch.is_tensor(dz_du):
                    in_tile = (tgt >= v0) & (tgt < v1)
                    local = (tgt - v0).clamp(0, v1 - v0 - 1)
                    target_slope += torch.where(in_tile, dz_du.gather(1, local[:, None]).squeeze(1), 0.0)
                e.mul_(dz_du).mul_(torch.exp(chunk.max - new_pivot)[:, None])
                rescale = torch.exp(run.max - new_pivot)[:, None]
                mm_token_rows(e, weight[v0:v1].float(), acc.mul_(rescale), accumulate=True)
                if lora is not None:
                    mm_token_rows(e, lora[1][v0:v1].float(), lora_acc.mul_(rescale), accumulate=True)
            run = softmax_stats.merge(softmax_stats.stack(run, chunk))
        records.append(run)
    if frozen_head and transform.softcap is None:
        slopes.fill_(transform.logit_scale / transform.temperature)
    stats = (
        SoftmaxStats(*(torch.cat(fields) for fields in zip(*records)))
        if records
        else SoftmaxStats(*(torch.zeros(0, device=dev) for _ in SoftmaxStats._fields))
    )
    return stats, grad, slopes, lora_grad


def backward(head, stats, grad_logp, grad_entropy, grads):
    """Accumulate into ``grads`` (an operands.HeadGrads of fp32 buffers, each may be None): d hidden [N, D],
    d weight [V, D], d bias [V], and with LoRA d lora_hidden [N, r], d lora_weight [V, r]. ``head``: the
    operands.HeadOperands.

    ``stats``: the forward's softmax_stats.BackwardStats; ``grad_logp`` = dL/dlogp [N]; ``grad_entropy`` =
    dL/dentropy [N] or None (then the stats' entropy values are unused).
    """
    hidden, weight, targets, _, _, lora = head
    N, V = hidden.shape[0], weight.shape[0]
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c = grad_logp[n0:n1]
        e = grad_entropy[n0:n1] if grad_entropy is not None else None
        if not bool((c != 0).any()) and (e is None or not bool((e != 0).any())):
            continue  # rows without a gradient (masked): exactly zero
        tgt = targets[n0:n1]
        lse = stats.lse[n0:n1]
        target_dz = c * stats.nontarget_mass[n0:n1]  # c (1 - p_y), and below e p_y (mean - z_y): carried, exact
        h = hidden[n0:n1].float()
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            z, dz_du = _logit_tile(head, n0, n1, v0, v1, slope=True)
            g = logit_grad(
                z,
                tgt - v0,
                c,
                e,
                lse,
                target_dz,
                stats.mean_logit[n0:n1] if e is not None else None,
                stats.mean_minus_target[n0:n1] if e is not None else None,
            )
            g.mul_(dz_du)
            if grads.hidden is not None:  # dH in blocks of token rows; add_tile_gradients then dW and db
                mm_token_rows(g, weight[v0:v1].float(), grads.hidden[n0:n1], accumulate=True)
            add_tile_gradients(g, h, weight, slice(n0, n1), slice(v0, v1), None, grads.weight, grads.bias)
            if grads.lora_hidden is not None:
                mm_token_rows(g, lora[1][v0:v1].float(), grads.lora_hidden[n0:n1], accumulate=True)
            if grads.lora_weight is not None:
                grads.lora_weight[v0:v1] += g.T @ lora[0][n0:n1].float()


def logit_grad(z, local_target, grad_logp, grad_entropy, lse, target_dz, mean_logit, mean_minus_target):
    """dL/dz of one tile z [n, c] (before the transform's slope) from dL/dlogp ``grad_logp`` and dL/dentropy
    ``grad_entropy`` [n] (or None): every non-target column from p = exp(z - lse), the target column (``local_target``
    [n], outside [0, c): not in this tile) from the carried target_dz = grad_logp (1 - p_y) and, with the entropy,
    mean_minus_target (BackwardStats' values for these rows)."""
    p = torch.exp(z - lse[:, None])
    g = p * -grad_logp[:, None]
    if grad_entropy is not None:
        # p is 0 where z is -inf: keep 0 * inf from forming a NaN
        g += p * (mean_logit[:, None] - z).masked_fill_(p == 0, 0.0) * grad_entropy[:, None]
    rows = torch.nonzero((local_target >= 0) & (local_target < z.shape[1])).squeeze(1)
    local = local_target[rows]
    column = target_dz[rows]
    if grad_entropy is not None:
        column = column + grad_entropy[rows] * p[rows, local] * mean_minus_target[rows]
    g[rows, local] = column
    return g


def add_tile_gradients(g, hidden_rows, weight, rows, cols, grad_hidden, grad_weight, grad_bias):
    """One logit-gradient tile's GEMMs into the fp32 accumulators (each None where not wanted): dH[rows] += g W[cols],
    dW[cols] += g^T hidden_rows, db[cols] += g's column sums. g: [n, c] fp32, hidden_rows: the tile's [n, D]."""
    if grad_hidden is not None:
        torch.addmm(grad_hidden[rows], g, weight[cols].float(), out=grad_hidden[rows])
    if grad_weight is not None:
        torch.addmm(grad_weight[cols], g.T, hidden_rows.float(), out=grad_weight[cols])
    if grad_bias is not None:
        grad_bias[cols] += g.sum(0)
