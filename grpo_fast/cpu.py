"""The kernels' algorithm in chunked PyTorch, for tensors on a device without Triton (a laptop's CPU).

Same math as kernels/linear_logprobs_fwd.py and kernels/linear_logprobs_bwd.py: the logits exist one
[chunk_n, chunk_v] fp32 tile at a time, the logsumexp is online over vocab chunks, and the backward recomputes
each tile to form g = c (onehot - softmax) / tau and accumulate dH, dW, db. Peak extra memory: one tile and its
softmax (2 x chunk_n x chunk_v fp32) plus fp32 dH / dW accumulators; never N x V.
"""

import torch

CHUNK_N = 1024
CHUNK_V = 8192


def _logit_tile(hidden, weight, bias, inv_temperature, n0, n1, v0, v1):
    z = hidden[n0:n1].float() @ weight[v0:v1].float().T
    if bias is not None:
        z += bias[v0:v1].float()
    return z.mul_(inv_temperature)


def linear_logprobs_fwd(hidden, weight, targets, bias, temperature, compute_entropy):
    """hidden [N, D], weight [V, D], targets [N] -> (logp [N], entropy [N] or None, lse [N]), fp32."""
    N, V = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if compute_entropy else None
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        tgt = targets[n0:n1]
        run_max = torch.full((n1 - n0,), float("-inf"), device=hidden.device)
        run_sumexp = torch.zeros(n1 - n0, device=hidden.device)
        run_zsum = torch.zeros(n1 - n0, device=hidden.device)
        target_logit = torch.zeros(n1 - n0, device=hidden.device)
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            z = _logit_tile(hidden, weight, bias, inv_t, n0, n1, v0, v1)
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
            entropy[n0:n1] = lse[n0:n1] - run_zsum / run_sumexp
    return logp, entropy, lse


def linear_logprobs_bwd(hidden, weight, targets, bias, lse, coef, temperature, grad_hidden, grad_weight, grad_bias):
    """Accumulate into fp32 grad_hidden [N, D], grad_weight [V, D], grad_bias [V] (each may be None)."""
    N, V = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c = coef[n0:n1]
        if not bool((c != 0).any()):
            continue  # fully masked rows: exactly zero gradient
        tgt = targets[n0:n1]
        h = hidden[n0:n1].float()
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            z = _logit_tile(hidden, weight, bias, inv_t, n0, n1, v0, v1)
            g = torch.exp(z.sub_(lse[n0:n1, None])).neg_()
            in_tile = (tgt >= v0) & (tgt < v1)
            rows = torch.nonzero(in_tile).squeeze(1)
            g[rows, tgt[rows] - v0] += 1.0
            g.mul_((c * inv_t)[:, None])
            if grad_hidden is not None:
                grad_hidden[n0:n1] += g @ weight[v0:v1].float()
            if grad_weight is not None:
                grad_weight[v0:v1] += g.T @ h
            if grad_bias is not None:
                grad_bias[v0:v1] += g.sum(0)
