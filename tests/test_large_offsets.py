"""Tensors whose elements lie 2^31 or more from their first one: the kernels' offsets must not wrap around.

A head with V x D >= 2^31 elements (Llama-3.1-405B's 128256 x 16384 is 2% below) or hidden states with
N x D >= 2^31 (262144 tokens x 8192) put rows past 2^31 elements; an offset formed as a 32-bit index times a 32-bit
stride wraps there and reads (or writes) the wrong memory, silently. Triton passes an int argument >= 2^31 as a
64-bit int by itself, but a row stride below 2^31 times a row index can still pass it: the kernels widen the index
to 64 bits first. The interpreter wraps 32-bit integers as a GPU does (numpy int32), so these tests run on a CPU.

To stay small in time and memory, each test reserves a buffer of a few billion elements that it never touches
(untouched pages cost no RAM) and builds its tensors as strided views over it, with a handful of rows written: a row
stride below 2^31, and some rows 2^31 elements or more past the first. The views start 2^31 elements into their
buffer, so that a wrapped (negative) offset reads wrong values inside the buffer instead of faulting. The
reference is the fp64 spec on compact copies of the same rows. Address space reserved at once: at most 9 GiB
(bf16) and 17 GiB (fp32) buffers; resident memory stays under 0.5 GB; about 20 s of CPU for the file.

Not covered here (tests/test_gpu.py covers them on a GPU, with real tensors past 2^31): the chunked backward's g
buffer and the fused backward's fp32 dW accumulator past 2^31 (every vocabulary tile of such a tensor is computed,
far too slow for the interpreter). The fused dH accumulator is covered: token blocks without a gradient are
skipped, so only the blocks at the far end of a real N x D buffer are computed. Nowhere covered: the token
kernel's row start b x T (2^31 tokens in one batch; one program walks a row of 2^30 tokens).
"""

import dataclasses

import pytest
import torch
import triton
from conftest import assert_grad_close

from grpo_fast import reference
from grpo_fast.head import ops as head_ops
from grpo_fast.head import paths as backends
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import backward as kbackward
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels import softmax_stats
from grpo_fast.kernels.operands import HeadGrads, HeadOperands

# strided CPU views past 2^31 elements under the interpreter; tests/test_gpu.py has the real tensors on a GPU
pytestmark = pytest.mark.interpreter_only

LIMIT = 2**31
F64 = torch.float64


def _reserve(numel, dtype, device="cpu"):
    """An uninitialised buffer of ``numel`` elements; on a CPU its pages are only mapped, never touched."""
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except (RuntimeError, MemoryError):
        pytest.skip(
            f"this machine cannot reserve {numel * torch.finfo(dtype).bits // 8 / 2**30:.1f} GiB of "
            "(untouched) address space"
        )


def far_rows(values, first_far):
    """A strided view equal to ``values`` [R, C] whose rows ``first_far`` and after start 2^31 elements or more past
    its first element, with a row stride below 2^31 (a 32-bit kernel argument); ``values`` is copied in.

    The view starts 2^31 elements into its buffer: a 32-bit offset that wrapped lands inside the buffer."""
    R, C = values.shape
    assert 2 <= first_far < R
    stride = -(-LIMIT // first_far)
    assert stride * (first_far - 1) + C <= LIMIT <= stride * first_far < 2**32 and stride < LIMIT
    view = _reserve(LIMIT + stride * (R - 1) + C, values.dtype, values.device).as_strided((R, C), (stride, 1), LIMIT)
    view.copy_(values)
    return view


def far_contiguous(shape, dtype):
    """An uninitialised contiguous tensor of ``shape``, starting 2^31 elements into its buffer (see far_rows)."""
    numel = shape[0] * shape[1]
    return _reserve(LIMIT + numel, dtype).as_strided(shape, (shape[1], 1), LIMIT)


# N tokens, vocabulary V, width D: two token blocks and two vocabulary tiles at the interpreter's block sizes,
# none full; the rows from FAR_TOKEN / FAR_VOCAB on lie past 2^31 elements in the far tensor
N, V, D = 19, 41, 24
FAR_TOKEN, FAR_VOCAB = 17, 38
TRANSFORM = dict(temperature=0.7, softcap=3.0)


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[-4:] = torch.tensor([V - 1, V - 2, V - 3, 0])  # far weight rows are targets, of far and near tokens
    return hidden, weight, bias, targets, g


@pytest.mark.slow
@pytest.mark.parametrize("path", ["chunked", "fused", "frozen"])
@pytest.mark.parametrize("far", ["hidden", "weight"])
def test_layer1_with_rows_past_2_31_elements_matches_reference(far, path, monkeypatch):
    # forward and backward of the autograd function on the Triton backend: the logit tiles' hidden / weight loads
    # (forward, backward), the fused backward's hidden / weight loads, the chunked backward's hidden slices; the
    # frozen-head path takes the far rows through its GEMMs
    hidden, weight, bias, targets, g = _inputs()
    far_hidden = far_rows(hidden, FAR_TOKEN) if far == "hidden" else hidden
    far_weight = far_rows(weight, FAR_VOCAB) if far == "weight" else weight
    frozen = path == "frozen"
    c_logp = torch.randn(N, generator=g)
    c_ent = None if frozen else torch.randn(N, generator=g)
    transform = LogitTransform(**TRANSFORM)

    frozen_calls = []
    original = backends.head_forward_frozen_head
    monkeypatch.setattr(backends, "head_forward_frozen_head", lambda *a: frozen_calls.append(1) or original(*a))
    leaves = [far_hidden.detach().requires_grad_()] + [
        x.detach().requires_grad_(not frozen) for x in (far_weight, bias)
    ]
    head = HeadOperands(*leaves[:2], targets, leaves[2], transform)
    logp, ent = head_ops.linear_logprobs_path(
        head, "triton", "auto" if frozen else "general", "fused" if path == "fused" else "chunked"
    )
    assert len(frozen_calls) == frozen
    ((c_logp * logp).sum() + ((c_ent * ent).sum() if c_ent is not None else 0.0)).backward()

    ref_leaves = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    ref_logp, ref_ent = reference.logprobs_and_entropy(
        ref_leaves[0], ref_leaves[1], targets, ref_leaves[2], compute_dtype=F64, **TRANSFORM
    )
    ((c_logp * ref_logp).sum() + ((c_ent * ref_ent).sum() if c_ent is not None else 0.0)).backward()
    torch.testing.assert_close(logp.detach(), ref_logp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.detach(), ref_ent, rtol=1e-5, atol=2e-5)
    for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, ref_leaves):
        if leaf.requires_grad:
            assert_grad_close(leaf.grad, ref.grad.float(), torch.bfloat16, name)


@pytest.mark.slow
def test_fused_backward_accumulates_grad_hidden_past_2_31_elements():
    # the fused backward's fp32 dH accumulator is [N, D] with the row stride D: real tokens past 2^31 elements.
    # Every token gets no gradient but a few around element 2^31 (token blocks without one are skipped), so the
    # kernel computes two token blocks of a 2^31-element problem; hidden is as long, untouched but those rows
    n_tokens, width, vocab = LIMIT // 16384 + 35, 16384, 40
    scored = torch.arange(LIMIT // width - 6, n_tokens)  # straddles element 2^31 and a token block boundary
    g = torch.Generator().manual_seed(6)
    hidden_rows = torch.randn(len(scored), width, generator=g).bfloat16()
    weight = (torch.randn(vocab, width, generator=g) * 0.02).bfloat16()
    bias = (torch.randn(vocab, generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, vocab, (n_tokens,), generator=g)
    coef = torch.zeros(n_tokens)
    coef[scored] = torch.randn(len(scored), generator=g)
    transform = LogitTransform(**TRANSFORM)

    ref_leaves = [x.double().requires_grad_() for x in (hidden_rows, weight, bias)]
    ref_logp, _ = reference.logprobs_and_entropy(
        ref_leaves[0], ref_leaves[1], targets[scored], ref_leaves[2], compute_dtype=F64, **TRANSFORM
    )
    (coef[scored] * ref_logp).sum().backward()
    # the backward's per-token statistics (softmax_stats.BackwardStats), from the fp64 reference
    lse, nontarget_mass = torch.zeros(n_tokens), torch.zeros(n_tokens)
    lse[scored] = torch.logsumexp(
        reference.logits(hidden_rows.double(), weight.double(), bias.double(), compute_dtype=F64, **TRANSFORM), dim=1
    ).float()
    nontarget_mass[scored] = (-torch.expm1(ref_logp.detach())).float()
    stats = softmax_stats.BackwardStats(lse, nontarget_mass, None, None)

    # large blocks keep the interpreter's program count and K-loop short; the offsets do not depend on them
    cfg = dataclasses.replace(
        kconfig.backward_config(torch.device("cpu"), torch.bfloat16, "fused"), block_n=128, block_d=2048
    )
    computed = torch.arange(scored[0] // cfg.block_n * cfg.block_n, n_tokens)  # the rows of the computed blocks
    hidden = far_contiguous((n_tokens, width), torch.bfloat16)
    hidden[computed] = 0.0
    hidden[scored] = hidden_rows
    grad_hidden = far_contiguous((n_tokens, width), torch.float32)
    grad_hidden[computed] = 0.0
    grad_weight = torch.zeros(vocab, width)
    grad_bias = torch.zeros(vocab)
    head = HeadOperands(hidden, weight, targets, bias, transform)
    kbackward.backward_fused(head, stats, coef, None, HeadGrads(grad_hidden, grad_weight, grad_bias), cfg)
    assert grad_hidden[computed[0] : scored[0]].abs().max() == 0.0
    # bf16 inputs: the kernel rounds g to bf16 for its products (as on a GPU), so bf16's bound, on the gradients as
    # autograd returns them (bf16); db sums fp32 g
    assert_grad_close(grad_hidden[scored].bfloat16(), ref_leaves[0].grad.float(), torch.bfloat16, "hidden")
    assert_grad_close(grad_weight.bfloat16(), ref_leaves[1].grad.float(), torch.bfloat16, "weight")
    assert_grad_close(grad_bias, ref_leaves[2].grad.float(), torch.float32, "bias")


@pytest.mark.slow
@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
def test_frozen_head_tile_kernel_reads_logits_past_2_31_elements(gemm_dtype):
    # the frozen-head forward's u buffer (token chunk x vocabulary chunk, fp32, about the size of W) and P' over it:
    # the tile kernel on u rows past 2^31 elements gives what it gives on a compact copy of the same rows
    rows, cols, v0 = N, V, 3
    g = torch.Generator().manual_seed(7)
    u = torch.randn(rows, cols, generator=g) * 4.0
    bias = (torch.randn(V + v0, generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, V + v0, (rows,), generator=g)
    cfg = kconfig.frozen_head_config(torch.device("cpu"))
    inv_temperature, logit_scale, softcap = LogitTransform(**TRANSFORM).kernel_scalars()
    results = []
    for u_in in (u.clone(), far_rows(u, FAR_TOKEN)):
        # P' in gemm_dtype over the first half of each u row's bytes (bf16), or u itself (fp32), as forward_frozen
        p = u_in if gemm_dtype == torch.float32 else u_in.view(gemm_dtype)[:, :cols]
        state = torch.zeros(kfrozen.STATE_ROWS, rows)
        state[0] = 0.5  # a running max from an earlier chunk: the rescale is exercised
        state[1:3] = 2.0
        state[7] = 2.0**-9  # and its P' scale
        kfrozen._frozen_chunk_kernel[(triton.cdiv(rows, cfg.block_n),)](
            u_in,
            p,
            bias[v0:],
            targets,
            state,
            rows,
            cols,
            v0,
            u_in.stride(0),
            p.stride(0),
            state.stride(0),
            inv_temperature,
            logit_scale,
            softcap,
            HAS_BIAS=True,
            HAS_SOFTCAP=True,
            COMPUTE_ENTROPY=True,
            BLOCK_N=cfg.block_n,
            BLOCK_V=cfg.block_v,
        )
        results.append((p.clone(), state))
    (p_near, state_near), (p_far, state_far) = results
    assert p_near.abs().max() > 0 and state_near[3].abs().min() > 0
    torch.testing.assert_close(p_far, p_near, rtol=0, atol=0)
    torch.testing.assert_close(state_far, state_near, rtol=0, atol=0)
