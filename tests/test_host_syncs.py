"""Host synchronisations of one grpo_fast.loss call (forward and backward) on the Triton path (the interpreter here):
at most one with the value checks (their flags and the scored-token count, read together), none without them, and
every named error still raised when the checks run; none in the torch backend's layer 2.

Counted: the dispatcher's scalar reads and data-dependent shapes (``aten._local_scalar_dense``, ``aten.nonzero``,
``aten.is_nonzero``, ``masked_select``, indexing with a bool tensor: each makes the host wait for the device) by a
TorchDispatchMode, which sees inside grpo_fast's ops (they run inline under a dispatch mode over real tensors,
grpo_fast.ops), plus ``Tensor.tolist`` / ``Tensor.item`` calls, which on a CPU tensor reach no dispatcher op
(on a GPU each is a copy to the host and a wait)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_fast

SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.masked_select.default,
}


class HostSyncs(TorchDispatchMode):
    """Records the host synchronisations of the operators run within (by name)."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if func in SYNC_OPS or bool_index:
            self.syncs.append(str(func))
        return func(*args, **kwargs)


def count_syncs(fn, monkeypatch):
    """(result of fn(), the list of its host synchronisations)."""
    mode = HostSyncs()
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            mode.syncs.append(f"Tensor.{_name}")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    with mode:
        out = fn()
    monkeypatch.undo()
    return out, mode.syncs


def _batch(weight_grad=False, seed=0, device="cpu"):
    """Drawn on CPU (the same numbers on every device), on ``device``."""
    g = torch.Generator().manual_seed(seed)
    B, T, D, V = 3, 9, 32, 77
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False  # a sequence without tokens
    x = dict(
        hidden=torch.randn(B, T, D, generator=g),
        weight=(torch.randn(V, D, generator=g) * 0.2),
        targets=torch.where(mask, torch.randint(0, V, (B, T), generator=g), -100),
        advantages=torch.randn(B, generator=g),
        completion_mask=mask,
        old_logprobs=-torch.rand(B, T, generator=g) * 4,
        ref_logprobs=-torch.rand(B, T, generator=g) * 4,
    )
    x = {k: v.to(device) for k, v in x.items()}
    x["hidden"].requires_grad_()
    x["weight"].requires_grad_(weight_grad)
    return x


LOSS_OPTIONS = [
    dict(beta=0.04),
    dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01),
    dict(loss_type="dr_grpo", importance_sampling_level="sequence", max_completion_length=9),
]


@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen_head", "general"])
@pytest.mark.parametrize("options", LOSS_OPTIONS, ids=["dapo_kl", "grpo_entropy", "dr_grpo_seq"])
def test_one_loss_call_reads_the_host_at_most_once(weight_grad, options, monkeypatch, device):
    x = _batch(weight_grad, device=device)

    def step(check_values):
        x["hidden"].grad = None
        loss, metrics = grpo_fast.loss(**x, backend="triton", check_values=check_values, **options)
        loss.backward()
        return loss.detach(), x["hidden"].grad.clone(), metrics

    (loss, grad, metrics), syncs = count_syncs(lambda: step(True), monkeypatch)
    assert syncs == ["Tensor.tolist"]
    (loss_off, grad_off, metrics_off), syncs_off = count_syncs(lambda: step(False), monkeypatch)
    assert syncs_off == []
    # the two row selections (exact, and the device partition with padding rows) give the same numbers
    torch.testing.assert_close(loss_off, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_off, grad, rtol=1e-5, atol=1e-7)
    assert metrics.keys() == metrics_off.keys()
    for name in metrics:
        assert metrics[name].device == loss.device and metrics[name].dim() == 0  # device tensors: TRL reads them
        torch.testing.assert_close(metrics_off[name], metrics[name], rtol=1e-5, atol=1e-7, equal_nan=True)
    # the torch backend's numbers (both layers' torch twins), on CPU copies (leaves as they are)
    x_cpu = {k: v.detach().cpu().requires_grad_(v.requires_grad) for k, v in x.items()}
    expected, _ = grpo_fast.loss(**x_cpu, backend="torch", **options)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.cpu(), x_cpu["hidden"].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", grpo_fast.LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_torch_layer2_never_reads_the_host(loss_type, level, monkeypatch):
    """grpo_fast.token_loss on the torch backend without the value checks, forward and backward, with every option
    that adds work (KL, delta, importance weights, the off-policy and top-entropy masks, the entropy bonus): no read."""
    x = _batch(seed=1)
    g = torch.Generator().manual_seed(2)
    B, T = x["completion_mask"].shape
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    entropy = (torch.rand(B, T, generator=g) * 4).requires_grad_()

    inputs = dict(entropy=entropy, old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"])
    inputs.update(sampling_logprobs=x["old_logprobs"] + 0.1, num_items_in_batch=torch.tensor(20.0))
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, delta=1.5, entropy_coef=0.01)
    options.update(off_policy_mask_threshold=0.2, top_entropy_quantile=0.5, backend="torch", check_values=False)

    def step():
        iw = 0.5 + torch.rand(B, T, generator=g)
        loss, metrics = grpo_fast.token_loss(
            logp, x["advantages"], x["completion_mask"], importance_weights=iw, **inputs, **options
        )
        loss.backward()
        return loss, metrics

    (loss, metrics), syncs = count_syncs(step, monkeypatch)
    assert syncs == []
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and torch.isfinite(entropy.grad).all()
    assert all(m.dim() == 0 for m in metrics.values())


def test_the_value_checks_still_name_each_bad_input(device):
    x = _batch(device=device)
    bad_targets = dict(x, targets=torch.where(x["completion_mask"], 80, 0))
    with pytest.raises(
        ValueError,
        match=r"targets must be token ids in \[0, V\) = \[0, 77\) where completion_mask "
        r"is 1, got values in \[80, 80\]",
    ):
        grpo_fast.loss(**bad_targets, backend="triton")
    bad_mask = dict(x, completion_mask=x["completion_mask"].float() * 2)
    with pytest.raises(ValueError, match="completion_mask must be bool or hold only 0 and 1"):
        grpo_fast.loss(**bad_mask, backend="triton")
    with pytest.raises(ValueError, match=r"num_items_in_batch must be >= 0, got -3.5"):
        grpo_fast.loss(**x, backend="triton", num_items_in_batch=torch.tensor(-3.5, device=device))
    # without the checks nothing is read: a bad target is then the caller's promise broken, not an error
    loss, _ = grpo_fast.loss(
        **x, backend="triton", check_values=False, num_items_in_batch=torch.tensor(4.0, device=device)
    )
    assert torch.isfinite(loss)


def test_device_entropy_quantile_is_torch_quantile_of_the_masked_values():
    from grpo_fast import reference
    from grpo_fast.grpo_loss import ops as loss_ops

    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        entropy = torch.rand(4, 11, generator=g) * 3
        mask = (torch.rand(4, 11, generator=g) > 0.5).float()
        for q in (0.2, 0.5, 0.8, 1.0 / 3.0):
            expected = reference.entropy_quantile_threshold(entropy, mask, q)
            got = loss_ops.device_entropy_quantile(entropy, mask, q)
            assert torch.equal(got, expected if expected is not None else torch.tensor(torch.inf))
    assert loss_ops.device_entropy_quantile(torch.rand(2, 3), torch.zeros(2, 3), 0.5) == torch.inf


def test_forward_kernel_skips_the_blocks_past_the_scored_count(device):
    """With the checks off the rows are a device partition (scored first, the count a device value): the Triton
    forward computes no block wholly past the count (placeholder records: logp 0, entropy 0, lse the padding
    logit), the others exactly as without a count, and loss, metrics and gradients equal those with the checks on."""
    from grpo_fast.head import ops as head_ops
    from grpo_fast.kernels import config as kconfig
    from grpo_fast.kernels import forward as kforward

    g = torch.Generator().manual_seed(5)
    N, D, V, scored = 150, 24, 53, 21
    hidden = torch.randn(N, D, generator=g)
    hidden[scored:] = 0.0  # padding rows are zeros, as the API builds them
    weight, targets = torch.randn(V, D, generator=g) * 0.3, torch.randint(0, V, (N,), generator=g)
    hidden, weight, targets = hidden.to(device), weight.to(device), targets.to(device)
    block = kconfig.forward_config(hidden.device, hidden.dtype).block_n
    computed = -(-scored // block) * block
    assert computed < N  # some blocks are skipped
    operands = head_ops.LinearOpOperands(hidden, weight, targets, None, None, None, 1.0, None, 1.0, "triton", "chunked")
    full = head_ops.linear_logprobs(operands, True, False)
    part = head_ops.linear_logprobs(operands, True, False, torch.tensor([scored], dtype=torch.int32, device=device))
    for name, a, b in zip(("logp", "entropy", "lse", "nontarget_mass"), full, part):
        assert torch.equal(a[:computed], b[:computed]), name
    logp, entropy, lse = part[:3]
    assert (logp[computed:] == 0).all() and (entropy[computed:] == 0).all()
    assert (lse[computed:] == kforward.PADDING_LOGIT.value).all()

    x = _batch(weight_grad=True, seed=3, device=device)
    x["completion_mask"][:, 1:] = False  # few scored tokens: most blocks are padding
    outs = []
    for check_values in (True, False):
        leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight")}
        loss, metrics = grpo_fast.loss(**dict(x, **leaves), backend="triton", check_values=check_values)
        loss.backward()
        outs.append((loss, metrics, [leaf.grad for leaf in leaves.values()]))
    (loss_on, metrics_on, grads_on), (loss_off, metrics_off, grads_off) = outs
    assert torch.equal(loss_on, loss_off)
    assert all(torch.equal(metrics_on[k], metrics_off[k]) for k in metrics_on)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
