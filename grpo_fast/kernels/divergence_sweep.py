"""The divergence head's record sweep and JSD sweep: both models' logit tiles in registers, folded into the records of
grpo_fast.kernels.divergence_records (which has their algebra), no [N, V] buffer.

* ``_sweep_kernel``, program (i, k): both models' BLOCK_N x BLOCK_V logit tiles (two K-loops, fp32 accumulators)
  over vocabulary split k, in one of two modes. The record sweep folds them into one record per model per split
  (and, for the combined GRPO + distillation head, gathers the student's logit at each target);
  ``_merge_splits_kernel`` folds a row's split records in order (one launch). The JSD sweep (a divergence with a
  mixture, divergence_records.Divergence.mixture): its second sweep over the finished records, summed over the
  splits (divergence_tile.jsd_terms). On sm_90 the tiles come through tensor descriptors (the copy engine;
  ``USE_TMA``), elsewhere through pointers; with ``LOGITS_IN_MEMORY`` (divergence_loss) from fp32 products in memory.
The argmax indices travel as fp32 in the split records (exact: V <= config.MAX_VOCAB < 2^24).

Memory: the split records, 14 or 15 fields x splits x N fp32 (splits: ``num_vocab_splits``, a few waves' worth), the
merged ones 15 x N. No tensor of size N x V.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .config import sweep_config
from .divergence_records import JsdSweep, Record, finish
from .divergence_tile import (
    PAST_VOCAB_LOGIT,
    jsd_terms,
    load_rows,
    load_saved,
    local_argmax,
    merge_records,
    pair_tiles,
    shared_arguments,
    split_range,
    store_record,
    tile_operands,
    tile_record,
)
from .launch import on_device, tensor_descriptors_fit

# the fields of one model's record in the split buffer, in Record's order
RECORD_FIELDS = len(Record._fields)
# the rows of one program of the splits' merge (memory-bound: 15 loads a row and split)
MERGE_BLOCK_N = 64


# the most waves the record sweep's vocabulary split adds to the unsplit launch's (num_vocab_splits): more splits fill
# the last wave better, and each adds a record to write and merge
EXTRA_WAVES = 8


def num_vocab_splits(N, V, config):
    """(num_splits, vocab_per_split) of the record sweep (a config with ``block_n``, ``block_v`` and
    ``target_programs``, the programs the GPU holds at once): the vocabulary split so that the programs fill whole
    waves.

    A launch of s splits takes about waves(s) x tiles(s) tile steps, waves(s) = cdiv(token blocks x s, wave) and
    tiles(s) = cdiv(vocabulary tiles, s), the longest program's share. The candidates are, for k waves up to
    EXTRA_WAVES more than the unsplit launch's, the most splits whose programs fit in k waves; the one of fewest
    steps is taken (the fewest splits on a tie).
    E.g. 100 token blocks on a wave of 132 leave 24 % of the GPU idle unsplit; 9 splits fill 7 waves to 97 %."""
    n_blocks = max(1, triton.cdiv(N, config.block_n))
    v_tiles = triton.cdiv(V, config.block_v)
    wave = config.target_programs

    def steps(splits):
        tiles = triton.cdiv(v_tiles, splits)
        return triton.cdiv(n_blocks * triton.cdiv(v_tiles, tiles), wave) * tiles

    unsplit_waves = triton.cdiv(n_blocks, wave)  # fewer waves than these hold no split at all
    candidates = sorted(
        {max(1, min(v_tiles, k * wave // n_blocks)) for k in range(unsplit_waves, unsplit_waves + EXTRA_WAVES + 1)}
    )
    vocab_per_split = triton.cdiv(v_tiles, min(candidates, key=steps)) * config.block_v
    return triton.cdiv(V, vocab_per_split), vocab_per_split


@triton.jit
def _merge_splits_kernel(
    split_ptr, out_ptr, N, num_splits, stride_field, WITH_TARGET: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Both models' records of a block of rows folded over the record sweep's splits, the lower vocabulary first (it
    wins ties, as in divergence_records.merge): split_ptr [fields, num_splits, N] (fields stride_field apart), out_ptr
    [fields, N]; with WITH_TARGET the target-logit field summed (one split holds each target, the others add 0)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    first = split_ptr + offs_n
    sm, sa, sr, sc, so, sz, su = load_rows(first, stride_field, mask)
    tm, ta, tr, tc, to, tz, tu = load_rows(first + 7 * stride_field, stride_field, mask)
    if WITH_TARGET:
        target_logit = tl.load(first + 14 * stride_field, mask=mask, other=0.0)
    for k in range(1, num_splits):
        split = first + k * N
        m, a, r, c, o, z, u = load_rows(split, stride_field, mask)
        sm, sa, sr, sc, so, sz, su = merge_records(sm, sa, sr, sc, so, sz, su, m, a, r, c, o, z, u)
        m, a, r, c, o, z, u = load_rows(split + 7 * stride_field, stride_field, mask)
        tm, ta, tr, tc, to, tz, tu = merge_records(tm, ta, tr, tc, to, tz, tu, m, a, r, c, o, z, u)
        if WITH_TARGET:
            target_logit += tl.load(split + 14 * stride_field, mask=mask, other=0.0)
    out = out_ptr + offs_n
    store_record(out, N, mask, sm, sa, sr, sc, so, sz, su)
    store_record(out + 7 * N, N, mask, tm, ta, tr, tc, to, tz, tu)
    if WITH_TARGET:
        tl.store(out + 14 * N, target_logit, mask=mask)


@triton.jit
def _sweep_kernel(
    hs,
    ws,
    bs_ptr,
    ht,
    wt,
    bt_ptr,
    out_ptr,
    targets_ptr,
    saved_ptr,
    argmax_ptr,
    N,
    V,
    Ds,
    Dt,
    vocab_per_split,
    stride_out,
    stride_saved,
    stride_hs,
    stride_ws,
    stride_ht,
    stride_wt,
    inv_temperature,
    s_logit_scale,
    s_softcap,
    t_logit_scale,
    t_softcap,
    beta,
    log_1m_beta,
    log_beta,
    JSD: tl.constexpr,
    S_HAS_BIAS: tl.constexpr,
    T_HAS_BIAS: tl.constexpr,
    S_HAS_SOFTCAP: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    DOT_FP32: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr,
    T_DOT_PRECISION: tl.constexpr,
    WITH_TARGET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One sweep of program (i, k) over its vocabulary split, written per split at out_ptr (fields stride_out apart).
    JSD false, the record sweep: both models' records (Record's fields, the student's then the teacher's), and with
    WITH_TARGET the student's logit at each token's target (0 where this split does not hold it) in the field after
    them. JSD true, the generalized JSD's second sweep: (jsd, excess) from the saved values (saved_ptr, argmax_ptr:
    load_saved's rows). The other mode's pointers are placeholders."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    v_begin, v_end = split_range(split, vocab_per_split, V)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    BIG: tl.constexpr = 2**30
    if JSD:
        s_max, s_log_sumexp, s_rest_mass, t_max, t_log_sumexp, t_rest_mass, top_log_ratio, _excess, s_top, t_top = (
            load_saved(saved_ptr, argmax_ptr, stride_saved, N, offs_n, n_mask)
        )
        jsd = tl.zeros((BLOCK_N,), tl.float32)
        excess = tl.zeros((BLOCK_N,), tl.float32)
    else:
        empty = tl.zeros((BLOCK_N,), tl.float32)
        # the running records start empty at a finite max (divergence_tile's module docstring): the first tile's
        # record wins their merge, which scales their finite shifts by 0
        no_max = tl.full((BLOCK_N,), PAST_VOCAB_LOGIT, tl.float32)
        sm, sa, sr, sc, so, sz, su = no_max, empty, empty, empty, empty, empty, empty
        tm, ta, tr, tc, to, tz, tu = no_max, empty, empty, empty, empty, empty, empty
        target_logit = empty
        if WITH_TARGET:
            targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    # a split is whole tiles (num_vocab_splits): the tiles' own mask at V is the split's
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v, zs, _, zt = pair_tiles(
            hs,
            ws,
            bs_ptr,
            ht,
            wt,
            bt_ptr,
            pid_n * BLOCK_N,
            v0,
            N,
            V,
            Ds,
            Dt,
            stride_hs,
            stride_ws,
            stride_ht,
            stride_wt,
            inv_temperature,
            s_logit_scale,
            s_softcap,
            t_logit_scale,
            t_softcap,
            S_HAS_BIAS,
            T_HAS_BIAS,
            S_HAS_SOFTCAP,
            T_HAS_SOFTCAP,
            USE_TMA,
            LOGITS_IN_MEMORY,
            DOT_FP32,
            S_DOT_PRECISION,
            T_DOT_PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
        )
        if JSD:
            tile_jsd, tile_excess = jsd_terms(
                zs,
                zt,
                offs_v,
                s_max,
                s_log_sumexp,
                s_rest_mass,
                t_max,
                t_log_sumexp,
                t_rest_mass,
                top_log_ratio,
                s_top,
                t_top,
                beta,
                log_1m_beta,
                log_beta,
            )
            jsd += tile_jsd
            excess += tile_excess
        else:
            m, a, r, c, o, z, u = tile_record(zs, zt, offs_v, BIG)
            sm, sa, sr, sc, so, sz, su = merge_records(sm, sa, sr, sc, so, sz, su, m, a, r, c, o, z, u)
            m, a, r, c, o, z, u = tile_record(zt, zs, offs_v, BIG)
            tm, ta, tr, tc, to, tz, tu = merge_records(tm, ta, tr, tc, to, tz, tu, m, a, r, c, o, z, u)
            if WITH_TARGET:
                # the tile's own value: at the argmax it is the record's max exactly
                target_logit += tl.sum(tl.where(offs_v[None, :] == targets[:, None], zs, 0.0), axis=1)
    out = out_ptr + split * N + offs_n
    if JSD:
        tl.store(out, jsd, mask=n_mask)
        tl.store(out + stride_out, excess, mask=n_mask)
    else:
        store_record(out, stride_out, n_mask, sm, sa, sr, sc, so, sz, su)
        store_record(out + 7 * stride_out, stride_out, n_mask, tm, ta, tr, tc, to, tz, tu)
        if WITH_TARGET:
            tl.store(out + 14 * stride_out, target_logit, mask=n_mask)


class SweepRecords(NamedTuple):
    """What the record sweep gives (``records``)."""

    student: Record  # [N], merged over the vocabulary splits; argmax global
    teacher: Record
    jsd_sweep: JsdSweep  # the JSD's second sweep over the same rows, for divergence_records.finish
    target_logit: torch.Tensor | None  # [N] fp32: the student's logit at each target (None without targets)


def forward(student, teacher, beta, config=None):
    """The divergence head's forward by the Triton kernels, over a whole vocabulary.

    Args:
        student: the student's ModelHead over N > 0 tokens (hidden and weight rows contiguous).
        teacher: the teacher's ModelHead, over the same tokens and vocabulary.
        beta: in [0, 1]: 0 the forward KL, 1 the reverse KL, between the generalized JSD.
        config: the sweep's ForwardConfig (None: ``config.sweep_config``'s).

    Returns:
        divergence_records.finish's (divergence [N] fp32, the student's entropy [N] fp32, saved [8, N] fp32,
        argmax [2, N] int64).

    Raises:
        ValueError: as ``records``.
    """
    sweep = records(student, teacher, beta, config=config)
    return finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)


def records(student, teacher, beta, config=None, offset=0, targets=None):
    """Both models' records over the weights' rows by the record sweep, and the JSD's second sweep over them.

    Args:
        student: the student's ModelHead over N > 0 tokens (hidden and weight rows contiguous), V > 0 weight rows.
        teacher: the teacher's ModelHead, over the same tokens and weight rows.
        beta: in [0, 1] (the JSD sweep's mixture weight).
        config: the ForwardConfig (None: ``config.sweep_config``'s).
        offset: the vocabulary entry of the weights' first row (a vocab-parallel shard's; 0 for a whole head).
        targets: None, or [N] int64 target ids, rows of these weights (the combined head, on a whole head): the
            record sweep also gathers the student's logit there.

    Returns:
        The SweepRecords: both models' records over these rows (the splits merged with divergence_records.merge,
        argmax global), the JSD sweep over these rows (given the whole vocabulary's finished records: it sums
        over these rows only), and the student's logit at each target.

    Raises:
        ValueError: no token or no weight row (a launch of no program; a caller's torch twin returns the empty
            outputs).
    """
    N = student.hidden.shape[0]
    V = student.weight.shape[0]
    if N == 0 or V == 0:
        raise ValueError(f"the divergence kernels need tokens and weight rows, got N = {N}, V = {V}")
    descriptors_fit = tensor_descriptors_fit(student.hidden, student.weight, teacher.hidden, teacher.weight)
    config = config or sweep_config(student.hidden.device, student.hidden.dtype, descriptors_fit)
    use_tma = config.use_tma and descriptors_fit
    pointers = (*tile_operands(student, use_tma, config), *tile_operands(teacher, use_tma, config))
    arguments = dict(USE_TMA=use_tma, **shared_arguments(student, teacher, beta, config))
    return sweep_records(pointers, arguments, N, V, config, student.hidden, offset, targets)


def sweep_records(pointers, arguments, N, V, config, like, offset=0, targets=None):
    """``records``' launches: the record sweep over N tokens and V weight rows, the splits' merge and the JSD sweep's
    closure, from the sweep kernel's six operands (``pointers``) and its other arguments but the sizes; ``like``: a
    tensor on the device."""
    dev = like.device
    num_splits, vocab_per_split = num_vocab_splits(N, V, config)
    grid = (triton.cdiv(N, config.block_n), num_splits)
    shared = dict(N=N, V=V, vocab_per_split=vocab_per_split, **arguments)
    with_target = targets is not None
    with on_device(like):
        split_records = torch.empty((2 * RECORD_FIELDS + with_target, num_splits, N), dtype=torch.float32, device=dev)
        # the record sweep reads no saved values: split_records stands in for their pointers
        _sweep_kernel[grid](
            *pointers,
            split_records,
            targets if with_target else split_records,
            split_records,
            split_records,
            stride_out=split_records.stride(0),
            stride_saved=0,
            JSD=False,
            WITH_TARGET=with_target,
            **shared,
        )
        fields = torch.empty((2 * RECORD_FIELDS + with_target, N), dtype=torch.float32, device=dev)
        _merge_splits_kernel[(triton.cdiv(N, MERGE_BLOCK_N),)](
            split_records,
            fields,
            N,
            num_splits,
            split_records.stride(0),
            WITH_TARGET=with_target,
            BLOCK_N=MERGE_BLOCK_N,
        )
        student_record, teacher_record = (
            Record(f[0], f[1].to(torch.int64) + offset, f[2], f[3], f[4], f[5], f[6] > 0)
            for f in (fields[:RECORD_FIELDS], fields[RECORD_FIELDS : 2 * RECORD_FIELDS])
        )
        target_logit = fields[2 * RECORD_FIELDS] if with_target else None

    def jsd_sweep(student_finished, teacher_finished, top_log_ratio):
        with on_device(like):
            saved = torch.stack(
                [*student_finished[:3], *teacher_finished[:3], top_log_ratio, torch.zeros_like(top_log_ratio)]
            )
            argmax = local_argmax(torch.stack([student_finished.argmax, teacher_finished.argmax]), offset, V)
            out = torch.empty((2, num_splits, N), dtype=torch.float32, device=dev)
            # the JSD sweep gathers no target: out stands in for the targets' pointer
            _sweep_kernel[grid](
                *pointers,
                out,
                out,
                saved,
                argmax,
                stride_out=out.stride(0),
                stride_saved=saved.stride(0),
                JSD=True,
                WITH_TARGET=False,
                **shared,
            )
            jsd, excess = out.sum(1).unbind(0)
        return jsd, excess

    return SweepRecords(student_record, teacher_record, jsd_sweep, target_logit)
