"""gemm.mm_fp32: the fp32 product of bf16 / fp16 operands, and its accumulating form on every torch the package
allows (torch's addmm took an fp32 `self` with bf16 operands only from pytorch #167931 on: pytorch #154086).

torch's CPU mm has no out_dtype kernel for bf16, so the cuBLAS branches are checked here twice: on the ``device``
fixture (a CUDA GPU: the real cuBLAS calls, with the probe's answer and with the fallback forced), and on CPU with
torch.mm / torch.addmm standing in for cuBLAS's (which form mm_fp32 picks, and the fallback's arithmetic)."""

import pytest
import torch

from grpo_fast.kernels import gemm


@pytest.fixture(autouse=True)
def _fresh_probe():
    gemm.addmm_out_dtype_accumulates.cache_clear()
    yield
    gemm.addmm_out_dtype_accumulates.cache_clear()


def _chunk_products(device, dtype, V=203, D=37, chunk=19, n_chunks=6, seed=3):
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        (
            torch.randn(chunk, V, device=device, generator=g).to(dtype),
            torch.randn(chunk, D, device=device, generator=g).to(dtype),
        )
        for _ in range(n_chunks)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("accumulate_form", ["probed", "fallback"])
def test_accumulated_chunk_products_stay_fp32(device, dtype, accumulate_form, monkeypatch):
    # dW += g^T H over chunks, as the chunked backward does: no chunk's product is rounded to bf16 / fp16 (2^-9
    # relative), so the sum stays within fp32 rounding of the exact one, whichever accumulating form runs
    if accumulate_form == "fallback":
        monkeypatch.setattr(gemm, "addmm_out_dtype_accumulates", lambda device, dtype: False)
    V, D = 203, 37
    grad_weight = torch.zeros(V, D, device=device)
    exact = torch.zeros(V, D, device=device, dtype=torch.float64)
    for g_rows, h_rows in _chunk_products(device, dtype):
        gemm.mm_fp32(g_rows.T, h_rows, grad_weight, accumulate=True, slab=64)
        exact += g_rows.double().T @ h_rows.double()
    err = (grad_weight.double() - exact).abs().max().item()
    assert err <= 1e-5 * exact.abs().max().item(), err


@pytest.fixture
def cublas_stand_in(monkeypatch):
    """mm_fp32 takes the cuBLAS branch on CPU tensors; torch.mm / torch.addmm accept out_dtype (fp32 operands in
    fp64, rounded once to fp32, as cuBLAS's fp32 accumulation of exact bf16 products would) and log their calls."""
    calls = []
    real_mm = torch.mm

    def mm(a, b, out_dtype=None, out=None):
        calls.append(("mm", out_dtype, a.shape[0]))
        product = real_mm(a.double(), b.double()).to(out_dtype or a.dtype)
        return product if out is None else out.copy_(product)

    def addmm(self, a, b, out_dtype=None, out=None):
        calls.append(("addmm", out_dtype, a.shape[0]))
        result = (self.double() + real_mm(a.double(), b.double())).to(out_dtype or a.dtype)
        return result if out is None else out.copy_(result)

    monkeypatch.setattr(gemm, "half_operands_on_cublas", lambda out, a, b: a.dtype == b.dtype)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    return calls


@pytest.mark.parametrize("accumulates", [True, False])
def test_the_accumulating_form_follows_the_probe(cublas_stand_in, accumulates, monkeypatch):
    # the probe's yes: one addmm(out_dtype) into out; its no: an mm(out_dtype) per slab of a's rows, added to out
    monkeypatch.setattr(gemm, "addmm_out_dtype_accumulates", lambda device, dtype: accumulates)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(13, 9, generator=g).bfloat16()
    b = torch.randn(9, 5, generator=g).bfloat16()
    start = torch.randn(13, 5, generator=g)
    out = start.clone()
    gemm.mm_fp32(a, b, out, accumulate=True, slab=5)
    expected = (
        [("addmm", torch.float32, 13)]
        if accumulates
        else [("mm", torch.float32, 5), ("mm", torch.float32, 5), ("mm", torch.float32, 3)]
    )
    assert cublas_stand_in == expected
    exact = start.double() + a.double() @ b.double()
    torch.testing.assert_close(out.double(), exact, rtol=2e-7, atol=2e-6)

    cublas_stand_in.clear()  # the non-accumulating product is one mm(out_dtype) either way
    gemm.mm_fp32(a, b, out, accumulate=False, slab=5)
    assert cublas_stand_in == [("mm", torch.float32, 13)]
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=2e-7, atol=2e-6)


def test_the_probe_says_no_when_torch_rejects_an_fp32_self_or_adds_wrong(monkeypatch):
    def rejects(*args, **kwargs):
        raise RuntimeError("self and mat2 must have the same dtype, but got Float and BFloat16")

    real_addmm = torch.addmm

    def drops_self(self, a, b, out_dtype=None, out=None):  # a broken accumulate: out = a @ b
        return out.copy_(torch.mm(a.float(), b.float()))

    def works(self, a, b, out_dtype=None, out=None):
        return real_addmm(self, a.float(), b.float(), out=out)

    for addmm, answer in ((rejects, False), (drops_self, False), (works, True)):
        gemm.addmm_out_dtype_accumulates.cache_clear()
        monkeypatch.setattr(torch, "addmm", addmm)
        assert gemm.addmm_out_dtype_accumulates(torch.device("cpu"), torch.bfloat16) is answer, addmm.__name__


def test_the_probe_runs_once_per_device_and_dtype(monkeypatch):
    calls = []
    real_addmm = torch.addmm
    monkeypatch.setattr(
        torch,
        "addmm",
        lambda self, a, b, out_dtype=None, out=None: (
            calls.append(a.dtype) or real_addmm(self, a.float(), b.float(), out=out)
        ),
    )
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float16, torch.bfloat16):
        assert gemm.addmm_out_dtype_accumulates(torch.device("cpu"), dtype)
    assert calls == [torch.bfloat16, torch.float16]


def test_on_cpu_the_probe_meets_torchs_missing_kernel_and_says_no():
    # why the cuBLAS branches need a stand-in here: the declared torch's CPU addmm(out_dtype) has no bf16 kernel
    # (NotImplementedError, a RuntimeError): the probe answers no instead of raising; CPU tensors never take the
    # cuBLAS branch anyway
    assert not gemm.half_operands_on_cublas(torch.zeros(1), torch.zeros(1).bfloat16(), torch.zeros(1).bfloat16())
    assert gemm.addmm_out_dtype_accumulates(torch.device("cpu"), torch.bfloat16) is False


# ------------------------------------------------------------------------------- products whose rows are tokens
def _token_rows(device, dtype, K, cols, M=200, seed=5):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype).to(device)
    b = torch.randn(K, cols, generator=g).to(dtype).to(device)
    start = torch.randn(M, cols, generator=g).to(device)
    return a, b, start


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one_call_a_block"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("shape", [(48, 300), (300, 48)], ids=["logits", "dH"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_row_products_ignore_the_row_count(device, dtype, shape, accumulate, batched, monkeypatch):
    """gemm.mm_token_rows (docs/batch-invariance.md): a token's row of the product is bitwise the same whatever the
    call's row count (1, 3, 7, a whole block, a block and one, several blocks and a remainder) and the row's position
    in it (first, last, inside a later block); against fp64, within fp32 rounding. ``one_call_a_block``: the
    per-block calls (a GPU's form) on this device too."""
    if not batched:
        monkeypatch.setattr(gemm, "BATCHED_BLOCKS", ())
    a, b, start = _token_rows(device, dtype, *shape)
    block = gemm.token_gemm_rows(device)
    probe = 2  # the row whose product is followed through every call

    def row_of(M, at):
        rows = torch.cat([a[3 : 3 + at], a[probe : probe + 1], a[3 + at : 3 + M - 1]])
        out = torch.cat([start[3 : 3 + at], start[probe : probe + 1], start[3 + at : 3 + M - 1]])
        gemm.mm_token_rows(rows, b, out, accumulate)
        return out[at]

    alone = row_of(1, 0)
    calls = [(M, at) for M in (3, 7, block, block + 1, 2 * block + 5) for at in {0, M // 2, M - 1}]
    off = [(M, at) for M, at in calls if M + 3 <= a.shape[0] and not torch.equal(row_of(M, at), alone)]
    assert not off, f"the row's product changed with the call's rows (M, position): {off}"
    exact = a[probe].double() @ b.double() + (start[probe].double() if accumulate else 0)
    torch.testing.assert_close(alone.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one_call_a_block"])
def test_token_row_buffers_holding_the_padding(device, batched, monkeypatch):
    """``rows=``: an ``a`` and an ``out`` that hold the last block's padding rows give the same M rows as buffers of
    exactly M rows (the padding read from ``a``, whatever it holds; written in ``out``); M = 0 writes nothing."""
    if not batched:
        monkeypatch.setattr(gemm, "BATCHED_BLOCKS", ())
    block = gemm.token_gemm_rows(device)
    M = block + 3
    padded = gemm.padded_rows(M, device)
    assert padded == 2 * block
    a, b, start = _token_rows(device, torch.float32, 48, 300, M=padded)
    a[M:] = float("nan")  # junk padding rows: a row of the product reads only its own
    for accumulate in (False, True):
        exact_rows = start[:M].clone()
        gemm.mm_token_rows(a[:M], b, exact_rows, accumulate)
        for a_rows, out_rows in ((padded, M), (M, padded), (padded, padded)):
            out = start[:out_rows].clone()
            gemm.mm_token_rows(a[:a_rows], b, out, accumulate, rows=M)
            assert torch.equal(out[:M], exact_rows), (accumulate, a_rows, out_rows)
    out = start.clone()
    gemm.mm_token_rows(a[:0], b, out[:0], accumulate=False)
    assert torch.equal(out, start)
    with pytest.raises(ValueError, match="pass rows="):
        gemm.mm_token_rows(a[:M], b, start, accumulate=False)


def test_token_row_products_on_fake_and_meta_tensors():
    """Only shapes are read: FakeTensorMode (torch.compile's tracing) and meta tensors run mm_token_rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for device in ("cpu", "meta"):
        a, b = torch.empty(70, 48, device=device), torch.empty(48, 300, device=device)
        out = torch.empty(70, 300, device=device)
        gemm.mm_token_rows(a, b, out, accumulate=True)
    with FakeTensorMode() as mode:
        a = mode.from_tensor(torch.randn(70, 48))
        b = mode.from_tensor(torch.randn(48, 300))
        out = mode.from_tensor(torch.zeros(70, 300))
        gemm.mm_token_rows(a, b, out, accumulate=False)
        gemm.mm_token_rows(a, b, out, accumulate=True)
        assert out.shape == (70, 300)


def test_default_token_chunks_are_whole_blocks():
    """The token chunks sized from D (and the trained head's from D and the weight's bytes) are multiples of every
    device's block from D = 256 on, so of a call's blocks only the last one pads; a test's small head keeps D
    rounded to 16."""
    from grpo_fast.kernels import forward_frozen

    assert all(gemm.TOKEN_CHUNK_ALIGN % rows == 0 for rows in gemm.TOKEN_GEMM_ROWS.values())
    align = gemm.TOKEN_CHUNK_ALIGN
    for D in (512, 896, 1152, 1536, 2048, 3584, 5120, 8192):
        assert gemm.chunk_rows(D) % align == 0 and D - align < gemm.chunk_rows(D) <= D
        assert gemm.chunk_size(10**6, D) == gemm.chunk_rows(D)
        assert forward_frozen.trained_chunk_size(10**6, 151936, D, 2) % align == 0  # D / 2 rows in bf16
    assert [gemm.chunk_rows(D) for D in (8, 48, 255)] == [16, 48, 240]
    assert gemm.chunk_size(7, 1536) == 7
