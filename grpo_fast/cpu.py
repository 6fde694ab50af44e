"""The kernels' algorithm in chunked PyTorch, for tensors on a device without Triton (a laptop's CPU).

Same math as kernels/linear_logprobs_fwd.py and kernels/logit_grad.py (see kernels/logit_tile.py for the logit
transform and the gradient): the logits exist one [chunk_n, chunk_v] fp32 tile at a time, the logsumexp is online
over vocab chunks, and the backward recomputes each tile to form
g = (c (onehot - p) + e p (mean - z)) dz/du and accumulate dH, dW, db. Peak extra memory: one tile and a few
same-sized temporaries (fp32), plus fp32 dH / dW accumulators; never N x V.
"""

import torch

CHUNK_N = 1024
CHUNK_V = 8192


def _logit_tile(hidden, weight, bias, transform, n0, n1, v0, v1, slope=False):
    """z = transform(h W^T + b) for one tile, fp32; with ``slope`` also dz/du (a tile, or a number without a soft-cap)."""
    a = hidden[n0:n1].float() @ weight[v0:v1].float().T
    if bias is not None:
        a += bias[v0:v1].float()
    a.mul_(transform.logit_scale)
    dz_du = transform.logit_scale / transform.temperature
    if transform.softcap is not None:
        x = a.div_(transform.softcap)
        e = torch.exp(-2.0 * x.abs())
        if slope:  # 1 - tanh^2 = 4e / (1 + e)^2, precise where tanh saturates
            dz_du = (4.0 * dz_du) * e / (1.0 + e).square()
        a = torch.tanh(x).mul_(transform.softcap)
    return (a.div_(transform.temperature), dz_du) if slope else a.div_(transform.temperature)


def linear_logprobs_fwd(hidden, weight, targets, bias, transform, compute_entropy):
    """hidden [N, D], weight [V, D], targets [N] -> (logp, entropy, lse, mean logit), [N] fp32 each.

    entropy and mean are None without ``compute_entropy``.
    """
    N, V = hidden.shape[0], weight.shape[0]
    logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if compute_entropy else None
    mean_logit = torch.empty_like(logp) if compute_entropy else None
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        tgt = targets[n0:n1]
        run_max = torch.full((n1 - n0,), float("-inf"), device=hidden.device)
        run_sumexp = torch.zeros(n1 - n0, device=hidden.device)
        run_zsum = torch.zeros(n1 - n0, device=hidden.device)
        target_logit = torch.zeros(n1 - n0, device=hidden.device)
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            z = _logit_tile(hidden, weight, bias, transform, n0, n1, v0, v1)
            new_max = torch.maximum(run_max, z.max(dim=1).values)
            pivot = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            rescale = torch.exp(run_max - pivot)
            p = torch.exp(z - pivot[:, None])
            run_sumexp = run_sumexp * rescale + p.sum(1)
            if compute_entropy:
                run_zsum = run_zsum * rescale + (p * torch.where(torch.isinf(z), torch.zeros_like(z), z)).sum(1)
            in_tile = (tgt >= v0) & (tgt < v1)
            local = (tgt - v0).clamp(0, v1 - v0 - 1)
            target_logit += torch.where(in_tile, z.gather(1, local[:, None]).squeeze(1), torch.zeros_like(run_max))
            run_max = new_max
        pivot = torch.where(torch.isinf(run_max), torch.zeros_like(run_max), run_max)
        lse[n0:n1] = pivot + torch.log(run_sumexp)
        logp[n0:n1] = target_logit - lse[n0:n1]
        if compute_entropy:
            mean_logit[n0:n1] = run_zsum / run_sumexp
            entropy[n0:n1] = lse[n0:n1] - mean_logit[n0:n1]
    return logp, entropy, lse, mean_logit


def linear_logprobs_bwd(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform,
                        grad_hidden, grad_weight, grad_bias):
    """Accumulate into fp32 grad_hidden [N, D], grad_weight [V, D], grad_bias [V] (each may be None).

    ``coef`` = dL/dlogp [N]; ``entropy_coef`` = dL/dentropy [N] or None (then ``mean_logit`` is unused).
    """
    N, V = hidden.shape[0], weight.shape[0]
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c = coef[n0:n1]
        e = entropy_coef[n0:n1] if entropy_coef is not None else None
        if not bool((c != 0).any()) and (e is None or not bool((e != 0).any())):
            continue  # rows without a gradient (masked): exactly zero
        tgt = targets[n0:n1]
        h = hidden[n0:n1].float()
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            z, dz_du = _logit_tile(hidden, weight, bias, transform, n0, n1, v0, v1, slope=True)
            p = torch.exp(z - lse[n0:n1, None])
            g = p * -c[:, None]
            in_tile = (tgt >= v0) & (tgt < v1)
            rows = torch.nonzero(in_tile).squeeze(1)
            g[rows, tgt[rows] - v0] += c[rows]
            if e is not None:
                # p is 0 where z is -inf: keep 0 * inf from forming a NaN
                g += p * (mean_logit[n0:n1, None] - z).masked_fill_(p == 0, 0.0) * e[:, None]
            g.mul_(dz_du)
            if grad_hidden is not None:
                grad_hidden[n0:n1] += g @ weight[v0:v1].float()
            if grad_weight is not None:
                grad_weight[v0:v1] += g.T @ h
            if grad_bias is not None:
                grad_bias[v0:v1] += g.sum(0)
