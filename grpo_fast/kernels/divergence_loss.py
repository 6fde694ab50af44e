"""The divergence and its loss's gradients in one pass (``loss_gradients``), for a loss whose dL/d div is known before
the forward (TRL's DistillationTrainer loss; RL and distillation in one call): per token chunk cuBLAS forms both
models' fp32 products once, and the divergence head's own kernels read them from memory (``LOGITS_IN_MEMORY``: the
record sweep, the JSD sweep, the g kernel: the same formulas, the tiles from memory instead of a dot); then cuBLAS dH
and dW. Three student sweeps and one teacher sweep, against ``divergence_sweep.forward`` +
``divergence_gradient.backward``'s four and two (five and three for the JSD).

Memory: g, rows x V in the student's dtype; both models' fp32 products, rows / 2 x V each; the merged records of
rows / 2 tokens. No tensor of size N x V.
"""

import torch

from . import softmax_stats
from .config import stored_configs
from .divergence_gradient import GScale, launch_g, student_gradients
from .divergence_records import TeacherSegments, finish, layer1_record, model_entropy
from .divergence_sweep import sweep_records
from .divergence_tile import local_argmax, pointers, shared_arguments
from .gemm import mm_fp32
from .launch import on_device, on_first_argument_device
from .operands import Layer1Gradient


def loss_chunk_rows(N: int, Ds: int) -> int:
    """Tokens per gradient GEMM of ``loss_gradients`` (the logits are formed for half of them at a time): half the
    student's width rounded down to 128 (384 at Qwen2.5-0.5B's Ds 896), at least 32, at most N. Its buffers, rows x V
    x (2 + 4) bytes of g and the two models' fp32 logits (4 + 4 from fp32 inputs), stay within 1.25x the unfused
    head's peak (dW's fp32 V x Ds x 4 and a g chunk of Ds x V in the student's dtype); fewer rows add dW's fp32
    accumulator traffic (V x Ds x 8 bytes a GEMM)."""
    return min(N, max(32, (Ds // 2) // 128 * 128))


def loss_workspace_bytes(N: int, Ds: int, V: int, itemsize: int, token_chunk=None, want_g: bool = True) -> int:
    """The bytes ``loss_gradients`` allocates besides its outputs, for a memory estimate: both models' fp32 products
    of half a chunk [rows / 2, V] each and the chunk's g [rows, V] in the student's dtype (``itemsize`` bytes; none
    where no gradient is wanted), rows = ``token_chunk`` or ``loss_chunk_rows``'s, at most N."""
    rows = min(N, token_chunk or loss_chunk_rows(N, Ds))
    half = (rows + 1) // 2
    return 2 * half * V * 4 + (rows * V * itemsize if want_g else 0)


@on_first_argument_device
def loss_gradients(student, teacher, beta, weights, grads, token_chunk=None, configs=None, layer1=None):
    """The divergence and its loss's gradients in one pass: the student's three GEMM sweeps and the teacher's one
    (against ``divergence_sweep.forward`` + ``divergence_gradient.backward``'s recompute: four and two), for the loss L
    = sum_n weights_n div_n, whose dL/d div is known before the forward (``weights``), plus with ``layer1`` a layer-2
    loss of the student's log-probs whose dL/dlogp is known token by token as soon as the token's log-prob is (the
    combined head's: the record sweep also gathers the student's logit at each target, layer 1's record follows from the
    student's (``divergence_records.layer1_record``), and g gains layer 1's term).

    Per chunk of rows (``token_chunk``, ``loss_chunk_rows``'s by default) and per half of it: cuBLAS forms both
    models' fp32 products u = H W^T (1), the record sweep and the JSD sweep read them (``LOGITS_IN_MEMORY``: the
    same kernels and formulas as ``divergence_sweep.records``, the tiles from memory), ``finish`` gives the rows'
    divergence, and the g kernel writes g = weights_n d div / d u_s into the chunk's g rows, rounded to the student's
    dtype (fp16's: first scaled by an exact power of two from the weights' bound, as ``divergence_gradient.backward``'s;
    bf16 has fp32's exponent range); then dH = g W_s (2) and dW += g^T H_s (3) on cuBLAS with fp32 outputs, db from
    the g kernel's column sums. Where no gradient is wanted (``grads`` all None) no g is formed.

    Memory: g, rows x V in the student's dtype; both models' fp32 products, rows / 2 x V each; the merged records
    of rows / 2 tokens; the fp32 gradients are the caller's.

    Args:
        student: the student's ModelHead over N > 0 tokens (rows contiguous), V > 0 weight rows.
        teacher: the teacher's ModelHead over the same tokens and weight rows, or TeacherSegments: several
            teachers, each over a range of them.
        beta: in [0, 1].
        weights: [N] fp32 dL/d div of each token, contiguous.
        grads: (grad_hidden [N, Ds], written; grad_weight [V, Ds] and grad_bias [V], zero on entry, accumulated),
            fp32, each None where not wanted.
        token_chunk: rows per gradient GEMM (None: ``loss_chunk_rows``'s).
        configs: (ForwardConfig, BackwardConfig) of the sweeps (None: ``stored_configs``').
        layer1: a LossLayer1, or None (bf16 or fp32 only: its dL/dlogp comes chunk by chunk, so no scale for fp16's
            range can be chosen before the first g).

    Returns:
        (divergence [N] fp32, the student's entropy [N] fp32 (with ``layer1`` by layer 1's record, as the log-probs),
        its log-probs [N] fp32 or None without ``layer1``, the teacher's entropy [N] fp32 from its record: no
        sweep of its own).

    Raises:
        ValueError: no token or no weight row; ``layer1`` with fp16 inputs.
    """
    _, grad_weight, grad_bias = grads
    N, Ds = student.hidden.shape
    V = student.weight.shape[0]
    if N == 0 or V == 0:
        raise ValueError(f"the divergence kernels need tokens and weight rows, got N = {N}, V = {V}")
    dev, dtype = student.hidden.device, student.hidden.dtype
    scaled = dtype == torch.float16
    if layer1 is not None and scaled:
        raise ValueError("loss_gradients with a layer-1 term takes bf16 or fp32 inputs, not fp16")
    sweep_config, g_config = configs or stored_configs(dev)
    rows = min(N, token_chunk or loss_chunk_rows(N, Ds))
    half = (rows + 1) // 2
    products = [torch.empty((half, V), dtype=torch.float32, device=dev) for _ in range(2)]
    want_g = any(grad is not None for grad in grads)
    g = torch.empty((rows, V), dtype=dtype, device=dev) if want_g else None
    scale = GScale.of([weights]) if scaled and want_g else None
    divergence = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    teacher_entropy = torch.empty(N, dtype=torch.float32, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev) if layer1 is not None else None
    segments = teacher if isinstance(teacher, TeacherSegments) else None
    if segments is not None:
        if segments.starts[-1] != N:
            raise ValueError(f"the teachers' segments cover {segments.starts[-1]} tokens, the student's {N}")
        teacher = segments.kernel_head(student)
    # the kernels read both products (rows V apart; a chunk's rows are the buffers' first ones, N masks the rest)
    operands = (products[0], products[0], pointers(student)[2], products[1], products[1], pointers(teacher)[2])
    stored = dict(USE_TMA=False, LOGITS_IN_MEMORY=True, stride_hs=V, stride_ht=V)
    sweep_arguments, g_arguments = (
        {**shared_arguments(student, teacher, beta, config), **stored} for config in (sweep_config, g_config)
    )
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        for n0 in range(r0, r1, half):
            n1 = min(n0 + half, r1)
            zs, zt = (z[: n1 - n0] for z in products)
            mm_fp32(student.hidden[n0:n1], student.weight.T, zs, accumulate=False)
            if segments is not None:
                segments.products(n0, n1, zt)
            else:
                mm_fp32(teacher.hidden[n0:n1], teacher.weight.T, zt, accumulate=False)
            targets = layer1.targets[n0:n1] if layer1 is not None else None
            sweep = sweep_records(operands, sweep_arguments, n1 - n0, V, sweep_config, zs, targets=targets)
            div, ent, saved, argmax = finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)
            divergence[n0:n1], entropy[n0:n1] = div, ent
            teacher_entropy[n0:n1] = model_entropy(sweep.teacher)
            layer1_term = None
            if layer1 is not None:
                record = layer1_record(sweep.student, targets, sweep.target_logit)
                logp[n0:n1], entropy[n0:n1], stats = softmax_stats.finish(record, True)
                grad_logp = layer1.coefficients(n0, n1, logp[n0:n1], entropy[n0:n1]).float().contiguous()
                layer1_term = Layer1Gradient(targets, torch.stack(tuple(stats)), grad_logp, None)
            if not want_g:
                continue
            with on_device(zs):
                g_rows = g[n0 - r0 : n1 - r0]
                argmax = local_argmax(argmax, 0, V)
                launch_g(
                    operands,
                    saved,
                    argmax,
                    weights[n0:n1],
                    slice(0, n1 - n0),
                    g_rows,
                    grad_bias,
                    scale,
                    layer1_term,
                    g_arguments,
                    g_config,
                )
        if want_g:
            student_gradients(g[: r1 - r0], student, r0, r1, grads, scale)
    if scale is not None and grad_weight is not None:
        grad_weight.mul_(scale.unscale)
    return divergence, entropy, logp, teacher_entropy
