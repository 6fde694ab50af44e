"""Compile every Triton kernel for real GPUs without having one: one card of every architecture class of the tile
tables (grpo_fast/kernels/tiles.py: sm_80 A100, sm_89 RTX 4090, sm_90 H100/H200, sm_100 B200, sm_120 RTX 5090).

Why: CI has no GPU. The interpreter checks the numbers, not the compiler: a kernel can pass every interpreter
test and still fail to compile for a GPU, ask for more shared memory than the card has (a launch-time
"out of resource"), or spill registers. This script runs the kernel wrappers with the GPU launch configuration
on small CPU stand-in tensors, records each launch instead of running it, compiles the recorded launch with
Triton's own compiler and the ptxas shipped in the triton wheel, and reads the cubin's resource use with the
cuobjdump shipped beside it: registers, shared memory, the CTAs per SM those allow (``ctas_per_sm``, from the class's
facts in tiles.ARCH_CLASSES), the tensor-core instruction (``tensor_core_instruction``) and, from the
SASS, the memory fences (MEMBAR, GPU and CTA scope) and the global atomics (value-returning ATOM, reductions RED).
Nothing runs on a device and no numbers are checked here (tests/test_gpu.py does that).
It exits non-zero when any variant fails to compile, asks for more shared memory than the card has, or spills
registers (tests/test_sm_compile.py runs it in CI).

The signature is specialised as Triton's JIT does at launch: pointers and ints divisible by 16 get the
divisibility hint, ints equal to 1 become constants. The stand-in shapes use real model widths (D = 1536,
the Qwen2.5-1.5B hidden size) so the hints match a real run; the vocabulary is cut to 4096, which changes no
compiled code (V only enters as a loop bound and a mask).

    TRITON_INTERPRET=0 python tools/sm_compile.py [--arch 80 89 90 100 120] [--json rows.json] [--only TEXT]
    TRITON_INTERPRET=0 python tools/sm_compile.py --arch 90 --mix   # and the forwards' SASS by pipe, a logit

``--mix`` counts the static SASS instructions outside the K loop by the pipe that runs them (``sass_instruction_mix``)
over the logits a thread holds: the epilogue's cost a logit, from which the sampler's tile candidates are argued
(docs/sampler-support.md).

It runs with every declared Triton (pyproject.toml: 3.6 to 3.9; .ci/run compiles with both ends). Triton 3.6's
compiler spills a few bytes in variants that 3.9's does not (.ci/run passes --allow-spill for it, and says which).
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("sm_compile needs the real compiler: run it with TRITON_INTERPRET=0")

# this checkout's kernels, not an installed grpo_fast's
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from grpo_fast.grpo_loss.options import LossOptions  # noqa: E402
from grpo_fast.head.transform import LogitTransform  # noqa: E402
from grpo_fast.kernels import (  # noqa: E402
    backward,
    divergence_gradient,
    divergence_loss,
    divergence_sweep,
    forward,
    forward_frozen,
    kept_rows,
    kept_set,
    tile_selection,
    tiles,
    token_loss,
    tuning,
)
from grpo_fast.kernels import config as kconfig  # noqa: E402
from grpo_fast.kernels.divergence_records import SAVED_FIELDS, ModelHead, divergence_of, finish  # noqa: E402
from grpo_fast.kernels.operands import (  # noqa: E402
    HeadGrads,
    HeadOperands,
    Layer1Gradient,
    LossLayer1,
    SamplerSupport,
    SupportGradient,
    TokenLossInputs,
)
from grpo_fast.kernels.softmax_stats import BackwardStats  # noqa: E402

# The architectures compiled: each class's reference card's capability (tiles.ARCH_CLASSES), and its facts (shared
# memory a block and an SM, resident warps and CTAs, the SMs of a launch's wave)
CLASSES = {c.capability: c for c in tiles.ARCH_CLASSES.values()}
# Registers are allocated per warp in units of 256 (per thread rounded up to 8) in 4 sub-partitions of 16384, and the
# system reserves 1 KiB of shared memory per CTA (sm_80 on): the occupancy calculator's rules on every class.
REGS_PER_SUBPARTITION, SUBPARTITIONS, REG_UNIT_PER_WARP, SMEM_RESERVED_PER_CTA = 16384, 4, 256, 1024
TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",  # a flag a row (kernels.tile_selection's resolved)
}


@dataclass
class Launch:
    kernel: object  # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](...)` records the launch instead of running it."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


@contextmanager
def recording(module, name):
    launches = []
    kernel = getattr(module, name)
    setattr(module, name, _Recorder(kernel, launches))
    try:
        yield launches
    finally:
        setattr(module, name, kernel)


def specialise(launch):
    """(signature, constexprs, attrs, options) for ASTSource / triton.compile, as the JIT would build them."""
    kw = dict(launch.kwargs)
    options = {"num_warps": kw.pop("num_warps", 4), "num_stages": kw.pop("num_stages", 3)}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(launch.kernel.params):
        value = launch.args[i] if i < len(launch.args) else kw[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, TensorDescriptor):  # a tile read through the copy engine (sm_90 and later)
            signature[param.name] = (
                f"tensordesc<{TRITON_TYPES[value.base.dtype]}[{','.join(map(str, value.block_shape))}]>"
            )
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = BaseBackend.parse_attr("D")
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[param.name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not (param.do_not_specialize or param.do_not_specialize_on_alignment):
                attrs[(i,)] = BaseBackend.parse_attr("D")
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{param.name}: cannot specialise a {type(value).__name__}")
    return signature, constexprs, attrs, options


def resource_usage(cubin):
    """{'REG': .., 'STACK': .., 'SHARED': .., 'LOCAL': ..} from cuobjdump -res-usage."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def ctas_per_sm(arch, regs, shared, num_warps):
    """The CTAs of this kernel one SM holds at once: the least that its registers, shared memory, warps allow."""
    regs_per_warp = -(-regs * 32 // REG_UNIT_PER_WARP) * REG_UNIT_PER_WARP
    by_regs = (REGS_PER_SUBPARTITION // regs_per_warp) * SUBPARTITIONS // num_warps
    card = CLASSES[arch]
    by_smem = card.smem_per_sm // (shared + SMEM_RESERVED_PER_CTA)
    by_warps = card.max_warps_per_sm // num_warps
    return min(by_regs, by_smem, by_warps, card.max_ctas_per_sm)


def _sass(cubin):
    """The cubin's SASS as [(address, opcode split at its dots, branch target or None)], in address order."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    # an instruction line: /*0a30*/  [@P0 | @!UP1]  OPCODE.MODIFIERS operands ;
    lines = re.findall(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass, re.M)
    return [
        (
            int(at, 16),
            op.split("."),
            int(m.group(1), 16) if op == "BRA" and (m := re.search(r"0x([0-9a-f]+)", rest)) else None,
        )
        for at, op, rest in lines
    ]


def sass_memory_ops(code):
    """{'MEMBAR_GPU': .., 'MEMBAR_CTA': .., 'ATOM': .., 'RED': ..} in the cubin's SASS: the memory fences of GPU or
    system scope (an acq_rel / seq_cst atomic compiles to one, with an L1 invalidation), those of CTA scope (Hopper
    emits them beside the async-proxy fence that hands shared memory to wgmma), the value-returning global atomics
    (ATOM / ATOMG; not shared memory's ATOMS) and the global reductions (RED / REDG); ``code``: ``_sass``'s."""
    ops = [op for _, op, _ in code]
    fences = [op for op in ops if op[0] == "MEMBAR"]
    return {
        "MEMBAR_GPU": sum(op[-1] != "CTA" for op in fences),
        "MEMBAR_CTA": sum(op[-1] == "CTA" for op in fences),
        "ATOM": sum(op[0] in ("ATOM", "ATOMG") for op in ops),
        "RED": sum(op[0] in ("RED", "REDG") for op in ops),
    }


# SASS opcodes by the pipe that runs them (sass_instruction_mix; anything else is "other": control, barriers). A
# scheduler issues one warp instruction a clock; the FMA pipe takes one a clock (FP32 add, multiply, FMA: 128 lanes
# a clock an SM from sm_86 on, 64 on sm_80), the ALU pipe one every other (FP32 min / max / compare / select,
# integer and logic: 64 lanes), IMAD the FMA pipe's heavy half (64 lanes), MUFU 16 lanes a clock an SM
INSTRUCTION_CLASSES = {
    "fp32 fma": "FADD FADD2 FMUL FMUL2 FFMA FFMA2 FSWZADD".split(),
    "fp32 alu": "FMNMX FMNMX3 FSETP FSEL FSET FCHK".split(),
    "int alu": "IADD IADD3 ISETP LOP3 SHF LEA SEL IABS IMNMX VIADD VIMNMX PLOP3 P2R R2P PRMT POPC FLO MOV CS2R SGXT"
    " S2R BMSK".split(),
    "imad": ["IMAD"],
    "mufu": ["MUFU"],
    "convert": "F2F F2I I2F F2FP I2FP FRND".split(),
    "shuffle": ["SHFL"],
    "memory": "LDG STG LDS STS LDSM STSM LDC LDCU LDGSTS LDTM STTM ATOM ATOMG ATOMS RED REDG UTMALDG UTMASTG".split(),
    "mma": "HMMA HGMMA IMMA UTCHMMA UTCQMMA UTCMMA".split(),
}
_CLASS_OF = {op: name for name, ops in INSTRUCTION_CLASSES.items() for op in ops}


def sass_instruction_mix(code):
    """{region: {class: static SASS instructions}} of a GEMM kernel (``code``: ``_sass``'s): "loop" the K loop (the
    innermost backward branches' spans that hold a tensor-core instruction), "outside" everything else (its
    prologue and the epilogue, straight code where a program computes one tile); classes as INSTRUCTION_CLASSES,
    the uniform datapath's U* (and R2UR, S2UR, VOTEU) as "uniform"."""
    # the K loop's mark: its tensor-core instructions, or an IEEE fp32 dot's FFMA (fp32 operands: no tensor core)
    mma = [at for at, op, _ in code if op[0] in INSTRUCTION_CLASSES["mma"]]
    mma = mma or [at for at, op, _ in code if op[0] == "FFMA"]
    # each mark's innermost backward branch: a loop's. The blocks placed after the last EXIT (out-of-line waits)
    # branch back into the code without being loops
    end = max((at for at, op, _ in code if op[0] == "EXIT"), default=code[-1][0] if code else 0)
    spans = sorted(((to, at) for at, _, to in code if to is not None and to <= at < end), key=lambda s: s[1] - s[0])
    loops = {next((lo, hi) for lo, hi in spans if lo <= a <= hi) for a in mma if any(lo <= a <= hi for lo, hi in spans)}
    mix = {"loop": {}, "outside": {}}
    for at, op, _ in code:
        uniform = (
            op[0] != "UTMALDG"
            and op[0] not in INSTRUCTION_CLASSES["mma"]
            and (op[0].startswith("U") or op[0] in ("R2UR", "S2UR", "VOTEU"))
        )
        name = "uniform" if uniform else _CLASS_OF.get(op[0], "other")
        region = mix["loop" if any(lo <= at <= hi for lo, hi in loops) else "outside"]
        region[name] = region.get(name, 0) + 1
    return mix


def tensor_core_instruction(ptx):
    """'tcgen05' (Blackwell's fifth-generation MMA, its accumulator in tensor memory), 'wgmma' (Hopper warpgroup
    MMA), 'mma' (mma.sync: Ampere, Ada, consumer Blackwell) or 'none': how the kernel's tl.dot runs."""
    if re.search(r"\btcgen05\.mma", ptx):
        return "tcgen05"
    if re.search(r"\bwgmma\.mma_async", ptx):
        return "wgmma"
    return "mma" if re.search(r"\bmma\.sync\.aligned", ptx) else "none"


def _inputs(dtype, N=48, D=1536, V=4096, bias=False):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=gen).to(dtype)
    weight = torch.randn(V, D, generator=gen).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    b = torch.randn(V, generator=gen).to(dtype) if bias else None
    per_token = torch.zeros(N)
    grad_logp = torch.ones(N)
    return hidden, weight, targets, b, per_token, grad_logp


def layer1_launches(
    arch, dtype, bias=False, entropy=True, softcap=None, entropy_grad=False, lora_dtype=None, rank=16, row_count=False
):
    """The launches of the forward, the chunked backward and the fused backward (dW on and off) for one dtype.

    ``entropy``: the forward computes the entropy; ``entropy_grad``: the backwards take dL/dentropy too;
    ``lora_dtype``: a LoRA operand pair of rank ``rank`` in that dtype (the fused backward computes its dl and dB);
    ``row_count``: the forward reads the scored rows' device count (the API's rows with check_values=False)."""
    hidden, weight, targets, b, per_token, grad_logp = _inputs(dtype, bias=bias)
    D, V = hidden.shape[1], weight.shape[0]
    lora, grad_lora = None, (None, None)
    if lora_dtype is not None:
        lora = (torch.randn(hidden.shape[0], rank).to(lora_dtype), torch.randn(V, rank).to(lora_dtype))
        grad_lora = (torch.zeros(hidden.shape[0], rank), torch.zeros(V, rank))
    transform = LogitTransform(temperature=0.7, softcap=softcap, logit_scale=1.0 if softcap is None else 0.5)
    stats = BackwardStats(
        per_token,
        per_token.clone(),
        per_token.clone() if entropy_grad else None,
        per_token.clone() if entropy_grad else None,
    )
    grad_entropy = grad_logp.clone() if entropy_grad else None
    out = []
    cfg = kconfig.gpu_record_config(
        dtype, arch, kconfig.wide_record_epilogue(softcap is not None, bias, lora is not None)
    )
    with recording(forward, "_tile_records_kernel") as launches, recording(forward, "_merge_parts_kernel") as merges:
        row_counts = torch.tensor([hidden.shape[0] // 2], dtype=torch.int32) if row_count else None
        forward.forward(HeadOperands(hidden, weight, targets, b, transform, lora), entropy, cfg, row_counts)
    out += [("fwd", launches[0]), ("fwd merge", merges[0])]
    wide_epilogue = softcap is not None or entropy_grad  # as grpo_fast.backends.triton_backend chooses
    cfg = kconfig.gpu_backward_config(dtype, "chunked", arch, wide_epilogue, lora is not None)
    grad_bias = torch.zeros(V) if bias else None
    with recording(backward, "_backward_kernel") as launches:
        grads = HeadGrads(torch.empty(hidden.shape), torch.zeros(V, D), grad_bias, *grad_lora)
        head = HeadOperands(hidden, weight, targets, b, transform, lora)
        backward.backward_chunked(head, stats, grad_logp, grad_entropy, grads, cfg)
    out += [("bwd chunked", launches[0])]
    cfg = kconfig.gpu_backward_config(dtype, "fused", arch, wide_epilogue)
    for name, grad_weight in (("bwd fused", torch.zeros(V, D)), ("bwd fused, frozen W", None)):
        with recording(backward, "_backward_kernel") as launches:
            grads = HeadGrads(torch.zeros(hidden.shape), grad_weight, grad_bias, *grad_lora)
            backward.backward_fused(head, stats, grad_logp, grad_entropy, grads, cfg)
        out += [(name, launches[0])]
    return out


def frozen_launch(arch, dtype, bias=False, softcap=None, entropy=True):
    """The frozen-head forward's tile kernel (the stand-in's 48 tokens x 4096 entries are one chunk: one launch)."""
    hidden, weight, targets, b, _, _ = _inputs(dtype, bias=bias)
    transform = LogitTransform(temperature=0.7, softcap=softcap, logit_scale=1.0 if softcap is None else 0.5)
    with recording(forward_frozen, "_frozen_chunk_kernel") as launches:
        head = HeadOperands(hidden, weight, targets, b, transform)
        forward_frozen.forward_frozen_head(head, entropy, kconfig.gpu_frozen_head_config(arch))
    return launches[0]


# the frozen-head forward: per dtype, and with a bias and a soft-cap, and without the entropy
FROZEN_VARIANTS = tuple(
    (f"fwd frozen {TRITON_TYPES[d]}", d, dict()) for d in (torch.bfloat16, torch.float16, torch.float32)
) + (
    ("fwd frozen bf16 +bias +softcap", torch.bfloat16, dict(bias=True, softcap=30.0)),
    ("fwd frozen fp32 +bias +softcap", torch.float32, dict(bias=True, softcap=30.0)),
    ("fwd frozen bf16 no entropy", torch.bfloat16, dict(entropy=False)),
)


# every constexpr path of the GRPO token kernel, each loss family with the options TRL 1.16 combines with it
TOKEN_LOSS_VARIANTS = (
    # name, loss options, per-token advantages, inputs (on-policy: no old log-probs; off-policy mask, top-entropy mask)
    ("clipped, token", dict(loss_type="dapo", delta=2.0), False, dict()),
    ("clipped, token, on-policy", dict(loss_type="dapo"), False, dict(on_policy=True)),
    (
        "sapo, sequence, on-policy",
        dict(loss_type="sapo", importance_sampling_level="sequence"),
        False,
        dict(on_policy=True),
    ),
    (
        "clipped, sequence (GSPO)",
        dict(loss_type="grpo", delta=2.0, importance_sampling_level="sequence"),
        False,
        dict(),
    ),
    ("clipped, per-token advantages", dict(loss_type="grpo", delta=2.0), True, dict()),
    ("cispo", dict(loss_type="cispo"), False, dict()),
    ("sapo", dict(loss_type="sapo"), False, dict()),
    ("vespo", dict(loss_type="vespo"), False, dict()),
    (
        "clipped, masks + bonus + bias-corrected KL",
        dict(loss_type="grpo", delta=2.0, off_policy_mask_threshold=0.5, top_entropy_quantile=0.2, entropy_coef=0.01),
        False,
        dict(off_policy=True, entropy_mask=True),
    ),
    (
        "clipped, sequence, masks + bonus + bias-corrected KL",
        dict(
            loss_type="grpo",
            delta=2.0,
            importance_sampling_level="sequence",
            off_policy_mask_threshold=0.5,
            top_entropy_quantile=0.2,
            entropy_coef=0.01,
        ),
        False,
        dict(off_policy=True, entropy_mask=True),
    ),
    (
        "vespo, masks + bonus + bias-corrected KL",
        dict(loss_type="vespo", off_policy_mask_threshold=0.5, top_entropy_quantile=0.2, entropy_coef=0.01),
        False,
        dict(off_policy=True, entropy_mask=True),
    ),
)


def token_loss_launches():
    """The GRPO token kernel for each variant of TOKEN_LOSS_VARIANTS, with every input on (a KL term too; the
    variants without "bias-corrected" in their name have use_bias_correction_kl off)."""
    B, T = 4, 37
    logp, old, ref, sampler, entropy = (torch.randn(B, T) for _ in range(5))
    mask = torch.ones(B, T)
    out = []
    for name, options, per_token_adv, inputs in TOKEN_LOSS_VARIANTS:
        adv = torch.randn(B, T) if per_token_adv else torch.randn(B)
        options = LossOptions(beta=0.04, epsilon_high=0.28, use_bias_correction_kl="bias-corrected" in name, **options)
        old_logprobs = None if inputs.get("on_policy") else old
        sampling = sampler if inputs.get("off_policy") else None
        batch = TokenLossInputs(logp, adv, mask, old_logprobs, ref, sampling, torch.rand(B, T), entropy)
        threshold = 1.5 if inputs.get("entropy_mask") else None
        with recording(token_loss, "_token_loss_kernel") as launches:
            token_loss.token_loss(batch, options, scale=0.25, entropy_threshold=threshold)
        out.append((f"token_loss {name}", launches[0]))
    return out


# layer 1's variants beyond one per dtype: a bias without entropy; a soft-cap, the entropy's gradient, both
LAYER1_EXTRA = (
    ("bf16 +bias, no entropy", dict(bias=True, entropy=False)),
    ("bf16 +softcap", dict(softcap=30.0)),
    ("bf16 +entropy grad", dict(entropy_grad=True)),
    ("bf16 +softcap, entropy grad", dict(softcap=30.0, entropy_grad=True)),
    ("fp32 +softcap, entropy grad", dict(softcap=30.0, entropy_grad=True)),
    # LoRA on the head: PEFT's default fp32 adapters over a bf16 base, and bf16 adapters
    ("bf16 +lora-fp32-adapters", dict(lora_dtype=torch.float32)),
    ("bf16 +lora-bf16-adapters", dict(lora_dtype=torch.bfloat16)),
    ("bf16 +row count", dict(row_count=True)),
)


# the divergence head (kernels/divergence_sweep.py, divergence_gradient.py): per dtype, the forward KL (one sweep +
# the backward), the JSD (its second sweep, its backward's mixture) and the reverse KL with biases and soft-caps on both
# models
DIVERGENCE_VARIANTS = tuple(
    (f"div {TRITON_TYPES[d]} beta={b}", d, dict(beta=b))
    for d in (torch.bfloat16, torch.float16, torch.float32)
    for b in (0.0, 0.5)
) + (
    # the reverse KL without a soft-cap or a bias: the g kernel's narrow epilogue (128 columns on sm_90)
    ("div bf16 beta=1", torch.bfloat16, dict(beta=1.0)),
    ("div bf16 beta=1 +bias +softcap", torch.bfloat16, dict(beta=1.0, bias=True, softcap=30.0)),
    ("div fp32 beta=1 +bias +softcap", torch.float32, dict(beta=1.0, bias=True, softcap=30.0)),
    # the combined GRPO + distillation head (grpo_fast.distillation.teacher): the forward's target gather, layer 1's
    # term in the backward (with and without the entropy's gradient)
    ("div bf16 beta=1 +loss", torch.bfloat16, dict(beta=1.0, layer1="logp")),
    ("div bf16 beta=0.5 +loss +entropy", torch.bfloat16, dict(beta=0.5, layer1="entropy")),
    ("div fp16 beta=0 +loss +entropy", torch.float16, dict(beta=0.0, layer1="entropy")),
    (
        "div fp32 beta=1 +bias +softcap +loss +entropy",
        torch.float32,
        dict(beta=1.0, bias=True, softcap=30.0, layer1="entropy"),
    ),
)


def _pair_heads(dtype, bias, softcap):
    """The divergence launches' student and teacher ModelHeads: 48 tokens, the teacher wider than the student
    (Qwen2.5-1.5B's D 1536 over Qwen2.5-0.5B's 896), V 4096; biases and a soft-cap where asked."""
    gen = torch.Generator().manual_seed(0)
    N, Ds, Dt, V = 48, 896, 1536, 4096
    hs, ht = torch.randn(N, Ds, generator=gen).to(dtype), torch.randn(N, Dt, generator=gen).to(dtype)
    ws, wt = torch.randn(V, Ds, generator=gen).to(dtype), torch.randn(V, Dt, generator=gen).to(dtype)
    bs, bt = (torch.randn(V, generator=gen).to(dtype) for _ in range(2)) if bias else (None, None)
    student = ModelHead(hs, ws, bs, LogitTransform(0.7, softcap, 1.0 if softcap is None else 0.5))
    return student, ModelHead(ht, wt, bt, LogitTransform(0.7, softcap, 1.0))


def divergence_launches(arch, dtype, beta, bias=False, softcap=None, layer1=None):
    """The divergence head's launches for one variant: the sweep kernel's record sweep ("div fwd") and JSD sweep
    ("div jsd", where 0 < beta < 1), the backward. The teacher is wider than the student (Qwen2.5-1.5B's D 1536
    over the stand-in's 896, Qwen2.5-0.5B's). ``layer1``: the combined head's variant ("logp": layer 1's log-prob
    term, "entropy": and the entropy's)."""
    student, teacher = _pair_heads(dtype, bias, softcap)
    N, Ds, V = student.hidden.shape[0], student.hidden.shape[1], student.weight.shape[0]
    out = []
    with (
        recording(divergence_sweep, "_sweep_kernel") as sweeps,
        recording(divergence_sweep, "_merge_splits_kernel") as merges,
    ):
        sweep = divergence_sweep.records(
            student,
            teacher,
            beta,
            targets=torch.zeros(N, dtype=torch.int64) if layer1 else None,
            config=kconfig.gpu_sweep_config(dtype, CLASSES[arch].sm_count, arch),
        )
        finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)  # the JSD's sweep, where 0 < beta < 1
    # the record sweep, then the JSD sweep (where 0 < beta < 1): one kernel, two modes
    out += [("div jsd" if launch.kwargs["JSD"] else "div fwd", launch) for launch in sweeps]
    out += [("div merge", merges[0])]
    saved = torch.zeros(len(SAVED_FIELDS), N)
    argmax = torch.zeros(2, N, dtype=torch.int64)
    layer1_term = None
    if layer1:
        layer1_term = Layer1Gradient(
            torch.zeros(N, dtype=torch.int64),
            torch.zeros(len(BackwardStats._fields), N),
            torch.ones(N),
            torch.ones(N) if layer1 == "entropy" else None,
        )
    with recording(divergence_gradient, "_g_kernel") as bwd:
        divergence_gradient.backward(
            torch.ones(N),
            student,
            teacher,
            saved,
            argmax,
            beta,
            (torch.empty(N, Ds), torch.zeros(V, Ds), torch.zeros(V) if bias else None),
            config=kconfig.gpu_g_config(
                dtype,
                layer1 is not None,
                arch,
                narrow_epilogue=kconfig.narrow_g_epilogue(student, teacher, divergence_of(beta), layer1 is not None),
            ),
            layer1=layer1_term,
        )
    return out + [("div bwd", bwd[0])]


# the fused distillation loss (kernels.divergence_loss.loss_gradients): the record sweep, the JSD sweep and the g kernel
# reading both models' products from memory (no dot), per dtype and mode, and with biases and soft-caps
STORED_VARIANTS = (
    ("div stored bf16 beta=1", torch.bfloat16, dict(beta=1.0)),
    ("div stored bf16 beta=0.5", torch.bfloat16, dict(beta=0.5)),
    ("div stored fp16 beta=0", torch.float16, dict(beta=0.0)),
    ("div stored bf16 beta=1 +bias +softcap", torch.bfloat16, dict(beta=1.0, bias=True, softcap=30.0)),
    ("div stored fp32 beta=0.5 +bias +softcap", torch.float32, dict(beta=0.5, bias=True, softcap=30.0)),
    # RL and distillation in one call: the record sweep gathers the target logit, g carries layer 1's term
    ("div stored bf16 beta=1 +loss", torch.bfloat16, dict(beta=1.0, layer1=True)),
    ("div stored bf16 beta=0.5 +loss", torch.bfloat16, dict(beta=0.5, layer1=True)),
)


def stored_launches(arch, dtype, beta, bias=False, softcap=None, layer1=False):
    """The fused loss's launches for one variant: "div stored fwd" (the record sweep), "div stored jsd" (where
    0 < beta < 1) and "div stored bwd" (the g kernel), at divergence_launches' shapes, one chunk; ``layer1``: with
    the GRPO loss's term (the target gather, layer 1's gradient in g)."""
    student, teacher = _pair_heads(dtype, bias, softcap)
    N, Ds, V = student.hidden.shape[0], student.hidden.shape[1], student.weight.shape[0]
    grads = (torch.empty(N, Ds), torch.zeros(V, Ds), torch.zeros(V) if bias else None)
    with (
        recording(divergence_sweep, "_sweep_kernel") as sweeps,
        recording(divergence_sweep, "_merge_splits_kernel"),
        recording(divergence_gradient, "_g_kernel") as bwd,
    ):
        divergence_loss.loss_gradients(
            student,
            teacher,
            beta,
            torch.ones(N),
            grads,
            N,
            kconfig.gpu_stored_configs(CLASSES[arch].sm_count, arch),
            LossLayer1(torch.zeros(N, dtype=torch.int64), lambda n0, n1, *_: torch.ones(n1 - n0)) if layer1 else None,
        )
    first_half = sweeps[: 1 + (0.0 < beta < 1.0)]  # the chunk's two halves launch alike
    return [("div stored jsd" if launch.kwargs["JSD"] else "div stored fwd", launch) for launch in first_half] + [
        ("div stored bwd", bwd[0])
    ]


def tuning_launches(arch):
    """The forward's launch at each tuning candidate beyond the fixed table's (kernels.tuning.record_candidates:
    what GRPO_FAST_TUNE=1 may time and choose), bf16, with the narrow epilogue and with a soft-cap's wide one."""
    out = []
    for softcap in (None, 30.0):
        hidden, weight, targets, _, _, _ = _inputs(torch.bfloat16)
        transform = LogitTransform(softcap=softcap)
        head = HeadOperands(hidden, weight, targets, None, transform)
        for cfg in tuning.record_candidates(torch.bfloat16, arch, softcap is not None)[1:]:
            with recording(forward, "_tile_records_kernel") as launches, recording(forward, "_merge_parts_kernel"):
                forward.forward_record(head, True, cfg)
            name = f"fwd tuning {tuning.config_name(cfg)}{' +softcap' if softcap else ''}"
            out.append((name, launches[0]))
    return out


# the replayed kept sets' kernels (kernels.kept_set): (family, launcher, its kernel's name)
KEPT_SET_KERNELS = (
    ("kept dot", kept_set.kept_dot, "_kept_dot_kernel"),
    ("kept grad rows", kept_set.kept_grad_rows, "_kept_grad_rows_kernel"),
    ("kept grad table", kept_set.kept_grad_table, "_sorted_grad_table_kernel"),
    ("kept dot rows", kept_set.kept_dot_rows, "_kept_dot_rows_kernel"),
    ("kept record rows", kept_set.kept_record_rows, "_kept_record_rows_kernel"),
)


def kept_set_launches():
    """[(variant, family, dtype name, Launch)] of the replayed kept sets' kernels, bf16 and fp32 operands."""
    N, K, E, V = 8, 40, 1536, 4096
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        x, y = torch.randn(N, E).to(dtype), torch.randn(V, E).to(dtype)
        ids, g = torch.randint(0, V, (N, K)), torch.randn(N, K)
        arguments = {
            "kept dot": (x, y, ids, torch.zeros(N, K)),
            "kept grad rows": (g, y, ids, torch.zeros(N, E)),
            "kept grad table": (g, x, ids, torch.zeros(V, E)),
            # a served teacher's student side at beta 0 (a bias, a soft-cap: the widest variant)
            "kept dot rows": (x, y, torch.randn(V).to(dtype), ids, g, LogitTransform(0.7, 30.0)),
            # the replayed record's rows a set far below its row's max (LoRA, a bias, a soft-cap: the widest)
            "kept record rows": (
                HeadOperands(
                    x, y, ids[:, 0], torch.randn(V).to(dtype), LogitTransform(0.7, 30.0), (x[:, :16], y[:, :16])
                ),
                ids,
                torch.zeros(4, N),
            ),
        }
        for family, launcher, kernel in KEPT_SET_KERNELS:
            with recording(kept_set, kernel) as launches:
                launcher(*arguments[family])
            out.append((f"{family} {TRITON_TYPES[dtype]}", family, TRITON_TYPES[dtype], launches[0]))
    return out


def kept_rows_launches():
    """[(variant, family, dtype name, Launch)] of the sampling parameters' row sweeps (kernels.kept_rows) over fp32
    rows of logits: the record with 0 and 64 candidates, the kept sums."""
    n, V = 8, 151936
    z, targets = torch.randn(n, V), torch.randint(0, V, (n,))
    out = []
    for candidates in (0, kept_rows.MAX_CANDIDATES):
        with recording(kept_rows, "_row_records_kernel") as launches:
            kept_rows.row_records(z, targets, candidates)
        out.append((f"kept rows record c{candidates}", "kept rows record", "fp32", launches[0]))
    with recording(kept_rows, "_kept_sums_kernel") as launches:
        kept_rows.kept_sums(z, targets, torch.zeros(n), torch.zeros(n))
    return out + [("kept rows sums", "kept rows sums", "fp32", launches[0])]


def tile_selection_launches():
    """[(variant, family, dtype name, Launch)] of the tile candidates' selection (kernels.tile_selection, one launch
    a launch of the sweep) at Qwen2.5's vocabulary in 256-column tiles: top-k, top-p, min-p (its sweeps over every
    entry), the three together; then the kept columns (with gradients: the tile width a runtime factor, one
    variant)."""
    n, tiles, V = 64, 594, 151936
    candidates = torch.randn(forward.candidate_fields(), tiles, n)
    m, s, target_logit = torch.zeros(n), torch.ones(n), torch.zeros(n)
    out = []
    for label, params in (
        ("top_k", dict(top_k=50)),
        ("top_p", dict(top_p=0.9)),
        ("min_p", dict(min_p=0.05)),
        ("all", dict(top_k=50, top_p=0.9, min_p=0.05)),
    ):
        outputs = (*torch.empty(3, n), torch.zeros(n, dtype=torch.bool))
        with recording(tile_selection, "_select_kernel") as launches:
            tile_selection.select(candidates, m, s, target_logit, SamplerSupport(**params), V, outputs)
        out.append((f"kept tile selection {label}", "kept tile selection", "fp32", launches[0]))
    columns = torch.randn(forward.candidate_fields(columns=True), tiles, n)
    ids, resolved = torch.empty((n, tile_selection.LISTED), dtype=torch.int64), torch.ones(n, dtype=torch.bool)
    with recording(tile_selection, "_kept_columns_kernel") as launches:
        tile_selection.kept_columns(columns, torch.zeros(n), resolved, 256, ids)
    return out + [("kept columns", "kept columns", "fp32", launches[0])]


def _sampler_sweep_variants(arch, wide=False):
    """(label, dtype, head, config) of the sampler's record sweeps (tile candidates, their columns, kept bits): bf16
    with and without a bias (the wide epilogue's tile), fp32 on 8 warps, each in
    ``triton_backend.support_record_config``'s tile (``wide``: the wide epilogue's columns, the columns' and kept
    bits')."""
    for label, dtype, bias in (
        ("bf16", torch.bfloat16, False),
        ("bf16 +bias", torch.bfloat16, True),
        ("fp32", torch.float32, False),
    ):
        hidden, weight, targets, b, _, _ = _inputs(dtype, bias=bias)
        head = HeadOperands(hidden, weight, targets, b, LogitTransform(temperature=0.7))
        cfg = kconfig.gpu_record_config(dtype, arch, wide or kconfig.wide_record_epilogue(False, bias, False))
        if dtype == torch.float32:  # as triton_backend.support_record_config
            cfg = dataclasses.replace(cfg, num_warps=8)
        yield label, dtype, head, cfg


def tile_candidate_launches(arch):
    """[(variant, family, dtype name, Launch)] of the forward with tile candidates (the sampler's pass,
    backends.support_tiles: no entropy, the log-prob pass's tile), bf16 with and without a bias (the wide epilogue's
    tile), fp32, without and with their columns (the pass with gradients); and first the same forward without them,
    bf16 (the plain log-prob pass the candidates extend: ``--mix fwd "fwd candidates"`` compares their
    instructions)."""
    hidden, weight, targets, _, _, _ = _inputs(torch.bfloat16)
    head = HeadOperands(hidden, weight, targets, None, LogitTransform(temperature=0.7))
    with recording(forward, "_tile_records_kernel") as launches, recording(forward, "_merge_parts_kernel"):
        forward.forward_record(head, False, kconfig.gpu_record_config(torch.bfloat16, arch))
    out = [("fwd bf16 no entropy", "fwd", "bf16", launches[0])]
    for columns, family in ((False, "fwd candidates"), (True, "fwd candidates columns")):
        for label, dtype, head, cfg in _sampler_sweep_variants(arch, wide=columns):
            with recording(forward, "_tile_records_kernel") as launches, recording(forward, "_merge_parts_kernel"):
                forward.forward_record(head, False, cfg, tile_candidates=lambda *_: None, candidate_columns=columns)
            out.append((f"{family} {label}", family, TRITON_TYPES[dtype], launches[0]))
    return out


def kept_bits_launches(arch):
    """[(variant, family, dtype name, Launch)] of the forward with replayed kept sets' bitmaps (the replayed sets'
    pass without gradients, ``forward.kept_record``: no entropy, the tile candidates' tile, bf16 with and without a
    bias, fp32; ``--mix fwd "fwd kept bits"`` compares their instructions with the plain pass's), their merge and the
    bitmaps' builder and the wide rows' clearing."""
    out = []
    for label, dtype, head, cfg in _sampler_sweep_variants(arch, wide=True):
        hidden, weight = head.hidden, head.weight
        kept_ids = torch.randint(-1, weight.shape[0], (hidden.shape[0], 1024))
        with (
            recording(forward, "_tile_records_kernel") as launches,
            recording(forward, "_merge_parts_kernel") as merges,
            recording(forward, "_kept_bits_kernel") as builds,
            recording(forward, "_clear_wide_rows_kernel") as clears,
        ):
            forward.kept_record(head, kept_ids, cfg)
        out.append((f"fwd kept bits {label}", "fwd kept bits", TRITON_TYPES[dtype], launches[0]))
        # the replayed sets' pass with gradients: layer 1's chunked backward with the support's term in its g, in
        # triton_backend.kept_backward_config's tile
        N, D = hidden.shape
        stats = BackwardStats(*(torch.randn(N) for _ in range(2)), None, None)
        support = SupportGradient(kept_ids, *(torch.randn(N) for _ in range(5)))
        bwd = kconfig.gpu_backward_config(dtype, "chunked", arch, True, False)
        if dtype == torch.float32:  # as triton_backend.kept_backward_config
            bwd = dataclasses.replace(bwd, num_warps=8)
        grads = HeadGrads(torch.empty(N, D), torch.zeros(weight.shape[0], D))
        with recording(backward, "_backward_kernel") as launches, recording(forward, "_kept_bits_kernel"):
            backward.backward_chunked(head, stats, torch.randn(N), None, grads, bwd, support=support)
        out.append((f"bwd chunked kept bits {label}", "bwd chunked kept bits", TRITON_TYPES[dtype], launches[0]))
    out.append(("kept bits merge", "kept bits merge", "fp32", merges[0]))
    out.append(("kept bits clear", "kept bits clear", "int32", clears[0]))
    return out + [("kept bits build", "kept bits build", "int32", builds[0])]


def all_launches(arch):
    """[(variant name, kernel family, dtype name, Launch)]: a family is one kernel at one launch configuration
    ("fwd", "bwd fused", "fwd frozen", ...), its variants the constexpr paths compiled for it."""
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out += [
            (f"{name} {TRITON_TYPES[dtype]}", name, TRITON_TYPES[dtype], launch)
            for name, launch in layer1_launches(arch, dtype)
        ]
    for label, kw in LAYER1_EXTRA:
        dtype = torch.float32 if label.startswith("fp32") else torch.bfloat16
        out += [
            (f"{name} {label}", name, TRITON_TYPES[dtype], launch)
            for name, launch in layer1_launches(arch, dtype, **kw)
        ]
    out += [
        (name, "fwd frozen", TRITON_TYPES[dtype], frozen_launch(arch, dtype, **kw))
        for name, dtype, kw in FROZEN_VARIANTS
    ]
    out += [(name, "fwd", "bf16", launch) for name, launch in tuning_launches(arch)]
    out += [
        (f"{family} {name[4:]}", family, TRITON_TYPES[dtype], launch)
        for name, dtype, kw in DIVERGENCE_VARIANTS
        for family, launch in divergence_launches(arch, dtype, **kw)
    ]
    out += [
        (f"{family} {name[11:]}", family, TRITON_TYPES[dtype], launch)
        for name, dtype, kw in STORED_VARIANTS
        for family, launch in stored_launches(arch, dtype, **kw)
    ]
    out += kept_set_launches() + kept_rows_launches() + tile_selection_launches()
    out += tile_candidate_launches(arch) + kept_bits_launches(arch)
    return out + [(name, "token_loss", "fp32", launch) for name, launch in token_loss_launches()]


def compiled_row(arch, launch):
    """One launch compiled for ``arch``: {REG, SHARED (static + dynamic, bytes), LOCAL, STACK, ctas_per_sm,
    MEMBAR_GPU, MEMBAR_CTA, ATOM, RED (sass_memory_ops), tensor_cores, instructions (sass_instruction_mix),
    logits_per_thread (a tile kernel's BLOCK_N x BLOCK_V over its threads, else None)}, or {error}."""
    signature, constexprs, attrs, options = specialise(launch)
    try:
        compiled = triton.compile(
            ASTSource(launch.kernel, signature, constexprs, attrs),
            target=GPUTarget("cuda", arch, 32),
            options=options,
        )
    except Exception as e:  # noqa: BLE001 - every compiler failure is a result to report
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    usage = resource_usage(compiled.asm["cubin"])
    row = dict(
        tensor_cores=tensor_core_instruction(compiled.asm["ptx"]),
        REG=usage["REG"],
        LOCAL=usage["LOCAL"],
        STACK=usage["STACK"],
        SHARED=usage["SHARED"] + compiled.metadata.shared,
    )
    row["ctas_per_sm"] = ctas_per_sm(arch, row["REG"], row["SHARED"], options["num_warps"])
    code = _sass(compiled.asm["cubin"])
    row["instructions"] = sass_instruction_mix(code)
    # a tile kernel's logits a thread holds: what the instructions outside its K loop are spent on (--mix)
    tile = [launch.kwargs.get(k, 0) for k in ("BLOCK_N", "BLOCK_V")]
    row["logits_per_thread"] = tile[0] * tile[1] // (32 * options["num_warps"]) or None
    return row | sass_memory_ops(code)


def _specialisation(arch, launch):
    """What the compiler sees of a launch: two launches alike in it compile to the same code."""
    signature, constexprs, attrs, options = specialise(launch)
    return (
        arch,
        launch.kernel.fn,
        *(tuple(sorted((k, repr(v)) for k, v in d.items())) for d in (signature, constexprs, attrs, options)),
    )


_PENDING = []  # (arch, launch) of each distinct specialisation, for the worker processes (forked: inherited)


def _compile_pending(i):
    return compiled_row(*_PENDING[i])


def compile_all(archs, jobs=None, only=None):
    """[{arch, kernel, family, dtype, num_warps, num_stages, smem_limit, descriptors, error, and compiled_row's}]: a
    row a variant (those whose name holds ``only``, if given), each distinct specialisation compiled once, by ``jobs``
    processes (default: one a core)."""
    variants = [
        (arch, *variant) for arch in archs for variant in all_launches(arch) if only is None or only in variant[0]
    ]
    keys = [_specialisation(arch, launch) for arch, _, _, _, launch in variants]
    distinct = list(dict.fromkeys(keys))
    _PENDING[:] = [next(v for v, k in zip(variants, keys) if k == key)[::4] for key in distinct]
    jobs = jobs or os.cpu_count() or 1
    if jobs > 1 and len(_PENDING) > 1:
        with multiprocessing.get_context("fork").Pool(min(jobs, len(_PENDING))) as pool:
            results = dict(zip(distinct, pool.map(_compile_pending, range(len(_PENDING)), chunksize=1)))
    else:
        results = {key: _compile_pending(i) for i, key in enumerate(distinct)}
    rows = []
    for (arch, name, family, dtype, launch), key in zip(variants, keys):
        signature, _, _, options = specialise(launch)
        row = {
            "descriptors": sum(v.startswith("tensordesc") for v in signature.values()),
            "arch": arch,
            "kernel": name,
            "family": family,
            "dtype": dtype,
            "num_warps": options["num_warps"],
            "num_stages": options["num_stages"],
            "smem_limit": CLASSES[arch].smem_per_block,
            "error": None,
        }
        rows.append(row | results[key])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(CLASSES), choices=list(CLASSES))
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    parser.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one a core)")
    parser.add_argument("--only", metavar="TEXT", help="only the variants whose name holds TEXT (e.g. 'kept ')")
    parser.add_argument(
        "--allow-spill",
        type=int,
        default=0,
        metavar="BYTES",
        help="a variant spilling at most BYTES (local + stack) is reported, not failed: for an older "
        "Triton's compiler (.ci/run's lowest declared Triton); default 0",
    )
    parser.add_argument(
        "--mix",
        nargs="*",
        metavar="FAMILY",
        help='also print the SASS instructions by class of these families\' variants (default: "fwd", "fwd '
        'candidates" and "fwd kept bits"), outside the K loop and per logit a thread holds',
    )
    args = parser.parse_args(argv)
    rows = compile_all(args.arch, args.jobs, args.only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = 0
    print(
        f"{'arch':>4}  {'kernel':<44} {'warps':>5} {'stages':>6} {'regs':>4} {'smem KiB':>8} {'limit':>6} "
        f"{'spill B':>7} {'MMA':>5} {'CTA/SM':>6} {'fence':>5} {'cta':>3} {'ATOM':>4} {'RED':>4}  status"
    )
    for r in rows:
        if r["error"]:
            status, bad = r["error"], bad + 1
            print(f"sm{r['arch']:<2}  {r['kernel']:<44} {r['num_warps']:>5} {r['num_stages']:>6}  {status}")
            continue
        over = r["SHARED"] > r["smem_limit"]
        spill = r["LOCAL"] + r["STACK"]
        spills = spill > args.allow_spill
        status = "OVER SHARED MEMORY" if over else ("spills" if spills else "spills (allowed)" if spill else "ok")
        bad += over or spills
        print(
            f"sm{r['arch']:<2}  {r['kernel']:<44} {r['num_warps']:>5} {r['num_stages']:>6} {r['REG']:>4} "
            f"{r['SHARED'] / 1024:>8.1f} {r['smem_limit'] // 1024:>6} {r['LOCAL'] + r['STACK']:>7} "
            f"{r['tensor_cores']:>5} "
            f"{r['ctas_per_sm']:>6} {r['MEMBAR_GPU']:>5} {r['MEMBAR_CTA']:>3} {r['ATOM']:>4} {r['RED']:>4}  {status}"
        )
    if args.mix is not None:
        families = args.mix or ("fwd", "fwd candidates", "fwd kept bits")
        print_mix([r for r in rows if r["family"] in families and not r["error"]])
    if bad:
        print(f"{bad} kernel variant(s) failed to compile, overflow shared memory or spill registers", file=sys.stderr)
    return 1 if bad else 0


def print_mix(rows):
    """A line a variant: its static SASS instructions in the K loop and outside it, and outside it per logit a thread
    holds (a program computes one tile: the epilogue's cost a logit, its prologue's share included), by class."""
    classes = [*INSTRUCTION_CLASSES, "uniform", "other"]
    print(
        f"\n{'arch':>4}  {'kernel':<36} {'logits':>6} {'loop':>5} {'outside':>7} {'a logit':>7}  "
        + " ".join(f"{c:>7}" for c in classes)
    )
    for r in rows:
        outside, per = r["instructions"]["outside"], r["logits_per_thread"] or 1
        print(
            f"sm{r['arch']:<2}  {r['kernel']:<36} {r['logits_per_thread'] or '-':>6} "
            f"{sum(r['instructions']['loop'].values()):>5} {sum(outside.values()):>7} "
            f"{sum(outside.values()) / per:>7.2f}  " + " ".join(f"{outside.get(c, 0) / per:>7.2f}" for c in classes)
        )


if __name__ == "__main__":
    sys.exit(main())
