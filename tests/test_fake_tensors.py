"""grpo_fast's functions under FakeTensorMode (fake CPU tensors) and on meta tensors: no value is read (the value
checks skip tensors without data), outputs and gradients have the real ones' shapes and dtypes (the ops' fake
implementations). Fake CUDA tensors are not tested here: on a CPU-only torch their forward runs, but the autograd
engine asks for a CUDA device guard in the backward and the process aborts."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_fast

B, T, D, V = 2, 5, 16, 40


def _inputs(dtype, device="cpu", weight_grad=False):
    hidden = torch.randn(B, T, D, dtype=dtype, device=device).requires_grad_()
    weight = torch.randn(V, D, dtype=dtype, device=device).requires_grad_(weight_grad)
    targets = torch.randint(0, V, (B, T), device=device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    adv = torch.randn(B, device=device)
    old = torch.randn(B, T, device=device)
    return hidden, weight, targets, mask, adv, old


def _check_all(inputs, backend, weight_grad):
    hidden, weight, targets, mask, adv, old = inputs
    logp = grpo_fast.logprobs(hidden, weight, targets, completion_mask=mask, backend=backend)
    assert logp.shape == (B, T) and logp.dtype == torch.float32
    lp, ent = grpo_fast.logprobs_and_entropy(hidden, weight, targets, completion_mask=mask, backend=backend)
    assert lp.shape == ent.shape == (B, T) and lp.dtype == ent.dtype == torch.float32
    for options in (
        dict(beta=0.04, ref_logprobs=old),
        dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01),
    ):
        loss, metrics = grpo_fast.loss(hidden, weight, targets, adv, mask, old_logprobs=old, backend=backend, **options)
        assert loss.shape == () and loss.dtype == torch.float32
        assert all(m.shape == () for m in metrics.values())
        grads = torch.autograd.grad(loss, [hidden, weight] if weight_grad else [hidden])
        assert grads[0].shape == hidden.shape and grads[0].dtype == hidden.dtype
        if weight_grad:
            assert grads[1].shape == weight.shape and grads[1].dtype == weight.dtype
    return loss


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen_head", "general"])
def test_fake_cpu_tensors(backend, weight_grad):
    with FakeTensorMode():
        loss = _check_all(_inputs(torch.bfloat16, weight_grad=weight_grad), backend, weight_grad)
        assert type(loss).__name__ == "FakeTensor"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen_head", "general"])
def test_meta_tensors(backend, weight_grad):
    loss = _check_all(_inputs(torch.float32, "meta", weight_grad), backend, weight_grad)
    assert loss.device.type == "meta"


def test_fake_outputs_have_the_real_sizes():
    """The fake implementations allocate what the real ones return (a memory tracker sees the right sizes)."""
    from grpo_fast.head import ops as head_ops

    hidden, weight, targets, *_ = _inputs(torch.float32)
    for frozen in (False, True):
        operands = head_ops.LinearOpOperands(
            hidden.detach().reshape(-1, D),
            weight.detach(),
            targets.reshape(-1),
            None,
            None,
            None,
            1.0,
            None,
            1.0,
            "triton",
            "chunked",
        )
        real = head_ops._linear_logprobs(*operands, True, frozen, None)
        with FakeTensorMode() as mode:
            fake = head_ops.linear_logprobs(operands.with_tensors(mode.from_tensor), True, frozen)
        assert [(r.shape, r.dtype) for r in real] == [(f.shape, f.dtype) for f in fake]


class Allocations(TorchDispatchMode):
    """The bytes of each empty / zeros allocation the dispatched ops make (what an op's real implementation holds)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default):
            self.sizes.append(out.numel() * out.element_size())
        return out


def test_workspace_bytes_is_what_the_kernels_allocate():
    """head_ops.workspace_bytes against the allocations a dispatch mode sees in the real Triton implementations (the
    ops run inline under a mode over real tensors): the chunked backward's g buffer and the forward's records."""
    from grpo_fast.head import ops as head_ops

    N, D, V = 40, 32, 300
    hidden = torch.randn(N, D, dtype=torch.bfloat16)
    weight = torch.randn(V, D, dtype=torch.bfloat16) * 0.2
    targets = torch.randint(0, V, (N,))
    operands = head_ops.LinearOpOperands(hidden, weight, targets, None, None, None, 1.0, None, 1.0, "triton", "chunked")
    mode = Allocations()
    with mode:
        _, _, lse, mass, mean, mmt, _, _ = head_ops.linear_logprobs(operands, True, False)
    records = head_ops.workspace_bytes("linear_logprobs", (N, D), V, torch.bfloat16, device_type="cpu")
    # the forward's three buffers: the partial records, the target logits, the merged record
    assert records == sum(mode.sizes[:3]), mode.sizes
    mode = Allocations()
    with mode:
        needs = [True, False, False, False, False]
        head_ops.linear_logprobs_backward(lse, mass, mean, mmt, torch.randn(N), None, operands, needs)
    g_bytes = head_ops.workspace_bytes("linear_logprobs_backward", (N, D), V, torch.bfloat16)
    assert g_bytes == min(N, D) * V * 2 and g_bytes in mode.sizes


def test_divergence_loss_workspace_is_what_its_kernels_allocate():
    """The Triton backend's divergence_loss_workspace_bytes (the memory estimator's model of the fused distillation
    loss's buffers) against the allocations a dispatch mode sees in the real implementation: both models' fp32
    products of half a chunk and the chunk's g in the student's dtype."""
    from grpo_fast.backends.resolver import named
    from grpo_fast.kernels.divergence_loss import loss_chunk_rows

    N, Ds, Dt, V = 80, 32, 48, 300
    g = torch.Generator().manual_seed(0)
    student = torch.randn(N, Ds, generator=g).bfloat16().requires_grad_()
    student_weight = (torch.randn(V, Ds, generator=g) * 0.2).bfloat16().requires_grad_()
    teacher = torch.randn(N, Dt, generator=g).bfloat16()
    teacher_weight = (torch.randn(V, Dt, generator=g) * 0.2).bfloat16()
    mode = Allocations()
    with mode:
        grpo_fast.distillation_loss(
            student[None], student_weight, teacher[None], teacher_weight, backend="triton", beta=0.5
        )
    rows = loss_chunk_rows(N, Ds)
    assert rows == 32 < N  # the default chunk: several of them
    buffers = [(rows + 1) // 2 * V * 4] * 2 + [rows * V * 2]
    assert all(mode.sizes.count(size) >= buffers.count(size) for size in buffers), mode.sizes
    assert named("triton").divergence_loss_workspace_bytes((N, Ds), V, torch.bfloat16, None) == sum(buffers)
    assert named("torch").divergence_loss_workspace_bytes((N, Ds), V, torch.bfloat16, None) == 0  # no fused loss


@pytest.mark.parametrize("loss_type", grpo_fast.LOSS_TYPES)
def test_workspace_bytes_bounds_the_torch_layer2s_temporaries(loss_type):
    """head_ops.workspace_bytes("token_loss", backend="torch") is at least the peak of the torch layer 2's live
    temporaries (every tensor an op returns, counted until it is freed; the returned dL/dlogp excluded), with every
    option on, at each importance level and advantage shape."""
    import weakref

    from grpo_fast.backends.resolver import TORCH
    from grpo_fast.grpo_loss import ops as loss_ops
    from grpo_fast.kernels.operands import TokenLossInputs

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.storages = set()

        def _freed(self, key, nbytes):
            self.storages.discard(key)
            self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in self.storages:
                    key, nbytes = x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()
                    self.storages.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(x, self._freed, key, nbytes)
            return out

    B, T = 8, 33
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) * 3
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    old, ref, sampler = (logp + 0.1 * torch.randn(B, T, generator=g) for _ in range(3))
    iw, entropy = 0.5 + torch.rand(B, T, generator=g), 4 * torch.rand(B, T, generator=g)
    bound = loss_ops.workspace_bytes((B, T), backend="torch")
    every_option = dict(
        beta=0.04, delta=1.2, off_policy_mask_threshold=0.1, top_entropy_quantile=0.5, entropy_coef=0.01
    )
    for level, advantages in (
        (lv, a) for lv in ("token", "sequence") for a in (torch.randn(B, generator=g), torch.randn(B, T, generator=g))
    ):
        options = grpo_fast.LossOptions(loss_type=loss_type, importance_sampling_level=level, **every_option)
        mode = LiveBytes()
        with mode:
            grad_logp, _, _ = TORCH.token_loss(
                TokenLossInputs(logp, advantages, mask, old, ref, sampler, iw, entropy),
                options,
                scale=torch.tensor(0.01),
                entropy_threshold=torch.tensor(2.0),
            )
        assert 0 < mode.peak - grad_logp.numel() * 4 <= bound, (level, advantages.shape)
