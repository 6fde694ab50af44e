"""The kernels' algorithm in chunked PyTorch, for tensors on a device without Triton (a laptop's CPU).

Same math as kernels/forward.py and kernels/backward.py (see kernels/tile.py for the logit transform and the
gradient): the logits exist one [chunk_n, chunk_v] fp32 tile at a time, the logsumexp is online
over vocab chunks, and the backward recomputes each tile to form
g = (c (onehot - p) + e p (mean - z)) dz/du and accumulate dH, dW, db. Peak extra memory: one tile and a few
same-sized temporaries (fp32), plus fp32 dH / dW accumulators; never N x V.

A frozen head (kernels/forward_frozen.py's math): ``forward_with_grad_hidden`` also accumulates J = d logp / dh
online with the logsumexp, so that the backward is dH = c J: two vocabulary GEMMs in all instead of three.
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


def forward(hidden, weight, targets, bias, transform, compute_entropy):
    """hidden [N, D], weight [V, D], targets [N] -> (logp, entropy, lse, mean logit), [N] fp32 each.

    entropy and mean are None without ``compute_entropy``.
    """
    return _forward(hidden, weight, targets, bias, transform, compute_entropy, grad_hidden=False)[:4]


def forward_with_grad_hidden(hidden, weight, targets, bias, transform, compute_entropy=True):
    """The frozen-head forward: ``forward``'s (logp, entropy, lse, mean logit) and J = d logp / d hidden [N, D] fp32.

    For a weight and bias that need no gradient and an entropy that needs none: the backward is then
    dH = (dL/dlogp)[:, None] * J, with no recompute and no third vocabulary GEMM (kernels/forward_frozen.py has the
    math). J is accumulated in fp32 with the logsumexp, rescaled whenever the running max moves; memory: J (N x D
    fp32) besides forward's tile. The outputs are bit for bit ``forward``'s.
    """
    return _forward(hidden, weight, targets, bias, transform, compute_entropy, grad_hidden=True)


def _forward(hidden, weight, targets, bias, transform, compute_entropy, grad_hidden):
    """(logp, entropy, lse, mean logit[, J]): the online logsumexp over vocab chunks, and with ``grad_hidden`` the
    online J = s'_y W_y - sum_v p_v s'_v W_v (s' = dz/du). The target's own term is kept out of the running sum and
    weighted by the running sum of the other entries' exp, so that 1 - p_y is never formed by cancellation."""
    N, V = hidden.shape[0], weight.shape[0]
    logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if compute_entropy else None
    mean_logit = torch.empty_like(logp) if compute_entropy else None
    grad = torch.empty((N, hidden.shape[1]), dtype=torch.float32, device=hidden.device) if grad_hidden else None
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        tgt = targets[n0:n1]
        run_max = torch.full((n1 - n0,), float("-inf"), device=hidden.device)
        run_sumexp = torch.zeros(n1 - n0, device=hidden.device)
        run_zsum = torch.zeros(n1 - n0, device=hidden.device)
        target_logit = torch.zeros(n1 - n0, device=hidden.device)
        if grad_hidden:
            acc = grad[n0:n1].zero_()  # sum_{v != y} exp(z_v - m) s'_v W_v, rescaled with the running max m
            run_rest = torch.zeros(n1 - n0, device=hidden.device)  # sum_{v != y} exp(z_v - m)
            target_slope = torch.zeros(n1 - n0, device=hidden.device)
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            if grad_hidden:
                z, dz_du = _logit_tile(hidden, weight, bias, transform, n0, n1, v0, v1, slope=True)
            else:
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
            if grad_hidden:
                rows = torch.nonzero(in_tile).squeeze(1)
                p[rows, local[rows]] = 0.0  # p now holds the other entries only
                run_rest = run_rest * rescale + p.sum(1)
                if torch.is_tensor(dz_du):
                    target_slope += torch.where(in_tile, dz_du.gather(1, local[:, None]).squeeze(1), 0.0)
                # torch.addmm with out=, not addmm_: the same in-place product, and FlopCounterMode counts it
                torch.addmm(acc.mul_(rescale[:, None]), p.mul_(dz_du), weight[v0:v1].float(), out=acc)
            run_max = new_max
        pivot = torch.where(torch.isinf(run_max), torch.zeros_like(run_max), run_max)
        lse[n0:n1] = pivot + torch.log(run_sumexp)
        logp[n0:n1] = target_logit - lse[n0:n1]
        if compute_entropy:
            mean_logit[n0:n1] = run_zsum / run_sumexp
            entropy[n0:n1] = lse[n0:n1] - mean_logit[n0:n1]
        if grad_hidden:
            if transform.softcap is None:
                target_slope.fill_(transform.logit_scale / transform.temperature)
            has_target = (tgt >= 0) & (tgt < V)
            w_y = weight[tgt.clamp(0, V - 1)].float()
            # J = (s'_y (1 - p_y) W_y - sum_{v != y} p_v s'_v W_v), with 1 - p_y = rest / sumexp
            w_y.mul_(torch.where(has_target, target_slope * run_rest, 0.0)[:, None])
            acc.neg_().add_(w_y).div_(run_sumexp[:, None])
    return logp, entropy, lse, mean_logit, grad


def backward(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform,
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
