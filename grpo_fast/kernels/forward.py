"""The forward of layer 1 (linear log-probs): each token's log-prob of its target and entropy, no [N, V] logits.

Math: z = the transformed logits of ``tile``. The vocabulary is cut into patches of TILES x BLOCK_V columns and the
tokens into blocks of BLOCK_N rows; one program computes one (token block, patch): each tile with the whole D loop
(fp32 accumulation on the tensor cores), folded into the patch's partial record per row,
    m = max z,   R = sum exp(z - m) over the columns but the target's,   Zr = sum exp(z - m)(z - m) likewise
(Zr only with the entropy); the program whose columns hold a row's target writes z_y. ``_merge_parts_kernel`` folds
a row's partials into softmax_stats's record against the merged max M:
    R = sum_k exp(m_k - M) R_k,   S = R + exp(z_y - M),   Z = sum_k exp(m_k - M)(Zr_k + (m_k - M) R_k)
                                                           + exp(z_y - M)(z_y - M),
so 1 - p_y = R / S is a sum of positive terms, never a difference (exact where a token is confident), and
``softmax_stats.finish`` turns the record into logp, H and what the backward reads.

With replayed kept sets (``kept_record``: the sampler's support; the wide ones, of more than KEPT_GATHERED ids, as
bitmaps: a token block of narrow sets alone skips this, their caller sums their gathers) each tile also sums the
plain sum's own terms over its kept logits but the target, by the bit of each logit in its row's bitmap: R_k = sum
exp(z_v - m) over kept v != y, against the patch's m (a bit test and a select a logit, no exponential of its own),
merged with the plain sums' scales; the merge then adds e_y = exp(z_y - M) where the target's bit is set, giving
kept_lse = M + log(R_k + e_y) and kept_nontarget_mass = R_k / (R_k + e_y): sums of positive terms. They keep fp32's
precision while the set's sum against M is at least exp(-KEPT_RANGE); a set below it (all its logits some 44 nats
under the row's max: the sampler kept a set the trainer finds that unlikely) is flagged per row and recomputed by the
caller (``backends.triton_backend.replayed_record``: the kept entries' gathers), a choice by the row's own values
alone.

With tile candidates (``forward_record``'s ``tile_candidates``: the sampler's parameters, ``backends.support_tiles``)
each tile lists a row's 3 largest logits and the 4th (``_tile_candidates``), and with gradients where the 3 lie
(``_tile_columns``).

Every program is independent (the tile, not the row, is the unit of parallel work): they run in grouped order
(``tl.swizzle2d``: GROUP_N token blocks walk each patch before the next) so that the programs resident at once
share H and W tiles in L2. On Hopper the tiles come through tensor descriptors (the copy engine; ``USE_TMA``),
elsewhere through pointers.

Memory: the partials, 2 or 3 fields x patches x rows fp32 (1 more with kept sets, and their bitmaps, ceil(V / 32) + 1
int32 a row, built per launch from the kept ids), are kept under PARTS_BYTES by taking the rows in chunks (one launch
each); the merged record is 5 x N fp32 (and the kept sets' 4 x N). No tensor of size N x V exists, in any dtype.
fp32 inputs use IEEE fp32 dots (no TF32); under TRITON_INTERPRET=1 the dot operands are upcast to fp32 (``DOT_FP32``,
``tile``).
"""

import torch
import triton
import triton.language as tl

from . import softmax_stats
from .launch import on_first_argument_device, tensor_descriptors_fit, tile_operand
from .tile import kept_bits_tile, logit_tile_at, lora_kernel_args

# a padding row's logit (rows past the scored count): far above any real logit, far below fp32's overflow
PADDING_LOGIT = tl.constexpr(1e30)
# the most bytes the partial records of one launch take: the rows of a launch are chosen to fit (at Qwen2.5's
# V = 151936 in 256-column tiles, 4096 rows with the entropy)
PARTS_BYTES = 32 * 2**20
# the kept set's sums share the plain record's pivot M (the row's max): a set whose sum against it is at least
# exp(-KEPT_RANGE) keeps its precision (a term fp32 flushes, below 2^-126, weighs under 2^-62 of it), one below is
# recomputed by the caller (``kept_record``); a backward's q_v = p_v exp(lse - kept_lse) likewise
KEPT_RANGE = tl.constexpr(44.0)
# a replayed set of at most KEPT_GATHERED ids is summed from its gathers (``kept_set.kept_record_rows``: K weight
# rows, ~3 KiB each at D 1536, cost less than a token's share of the bitmap epilogue up to some 80 entries); a wider
# one from the bitmap sweep, whose epilogue a token block of narrow sets alone skips
KEPT_GATHERED = 64
# the logits a tile lists a row for the sampler's kept set (``forward_record``'s ``tile_candidates``): its 3 largest,
# ties repeated, beside the 4th largest, which bounds the rest. A row's 64 largest logits spread over V = 151936 in
# 128-column tiles (1187) put 4 in one tile with probability 3.5e-4 if placed at random (256 columns: 2.7e-3); such a
# row's entries do not show its cut, and its caller takes another path. Two entries a tile: 2.7e-2 (1.0e-1).
TILE_CANDIDATES = 3


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN if either is: a NaN logit reaches its tile's largest (the row's record, then the caller's
    fallback), and max(x, -inf) folds to x in the compiled network (maxnum's does not: NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _top_four(a1, a2, a3, a4, b1, b2, b3, b4):
    """The 4 largest of two descending quadruples' 8 values, descending, ties repeated: a bitonic merge. d_i =
    max(a_i, b_{5-i}) holds the 4 largest (a half-cleaner: a descends, b reversed ascends, so d falls then rises),
    then two levels of compare-exchange sort d: 12 min / max (the formula c_k = max over i + j = k of min(a_i, b_j)
    takes 16), fewer where -inf's fold (a logit's quadruple: 9 into a full one, 2 with another logit's)."""
    d1 = _max_nan(a1, b4)
    d2 = _max_nan(a2, b3)
    d3 = _max_nan(a3, b2)
    d4 = _max_nan(a4, b1)
    e1 = _max_nan(d1, d3)
    e3 = tl.minimum(d1, d3)
    e2 = _max_nan(d2, d4)
    e4 = tl.minimum(d2, d4)
    return _max_nan(e1, e2), tl.minimum(e1, e2), _max_nan(e3, e4), tl.minimum(e3, e4)


@triton.jit
def _tile_candidates(z):
    """A tile's 4 largest logits a row, descending, ties repeated ([BLOCK_N] each): one reduction whose combine
    merges top-four quadruples (each logit enters as (z, -inf, -inf, -inf)). The first is the tile's max (the
    record's), the first 3 are the tile's entries, the 4th bounds every other logit of the tile: no count, no
    distinct values, so a tie is listed as often as it occurs or lies at or below the bound."""
    none = tl.full(z.shape, float("-inf"), tl.float32)
    return tl.reduce((z, none, none, none), 1, _top_four)


# a tile's column field (``_tile_columns``): the sums over A_1, A_2, A_3 in bits 0-9, 10-19 and 20-31
COLUMN_FIELD_BITS = 10
_SECOND_FIELD = tl.constexpr(1 << COLUMN_FIELD_BITS)
_THIRD_FIELD = tl.constexpr(1 << (2 * COLUMN_FIELD_BITS))


@triton.jit
def _tile_columns(z, top1, top2, top3):
    """Where a tile's 3 entries lie, one int32 a row: F_k = sum of the columns j (0 .. BLOCK_V - 1) over A_k = {j :
    z_j >= top_k}, k = 1, 2, 3, in bits 0-9, 10-19 and 20-31 (A_1 within A_2 within A_3: a column of A_1 adds j to
    all three). Where |A_k| = k (top_k above the tile's next logit), the k-th entry's column is F_k - F_(k-1)
    (``support_tiles.kept_columns``). A larger A_k (a tie, or a tile of -inf) carries only into the fields above it,
    which a tie leaves undecoded too. Per logit: 3 compares, selects of constants, a multiply and an integer sum
    (written as a select of the product over A_3: Triton 3.6 and 3.9 compile it without a spill on every class,
    where other forms spilled on sm_90 or sm_100)."""
    tl.static_assert(z.shape[1] * 3 <= _SECOND_FIELD, "3 columns' sum fits a field")
    column = tl.arange(0, z.shape[1])[None, :]
    in3 = z >= top3[:, None]
    fields = tl.where(
        z >= top2[:, None],
        tl.where(z >= top1[:, None], 1 + _SECOND_FIELD + _THIRD_FIELD, _SECOND_FIELD + _THIRD_FIELD),
        _THIRD_FIELD,
    )
    return tl.sum(tl.where(in3, column * fields, 0), axis=1)


@triton.jit
def _kept_bit(kept_bits_ptr, stride_kept_row, rows, columns, mask):
    """Whether column ``columns`` is in row ``rows``' kept set: bit (v & 31) of the row's word v >> 5 (0 where
    masked)."""
    word = tl.load(kept_bits_ptr + rows * stride_kept_row + (columns >> 5), mask=mask, other=0)
    return ((word >> (columns & 31)) & 1) != 0


@triton.jit
def _kept_tile(e, offs_n, v0, n_mask, V, kept_bits_ptr, stride_kept_row):
    """A tile's sum of ``e`` (the plain record's exp(z - pivot), 0 at the target) over its row's kept entries: the
    kept set's non-target sum against the plain record's own pivot (a bit test and a select a logit, no exponential
    of its own)."""
    kept = kept_bits_tile(kept_bits_ptr, stride_kept_row, offs_n, v0, n_mask, V, e.shape[0], e.shape[1])
    return tl.sum(tl.where(kept, e, 0.0), axis=1)


@triton.jit
def _kept_bits_kernel(
    kept_ids_ptr,
    bits_ptr,
    wide_ptr,
    K,
    V,
    stride_ids,
    stride_bits,
    held_word,
    WIDE_ONLY: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A launch's rows' kept sets as bitmaps: bit v & 31 of word v >> 5 of row n set for each id v of
    kept_ids[n] (-1 and ids outside [0, V) skipped; an id twice sets its bit once), and word ``held_word`` nonzero
    where the row holds any; with WIDE_ONLY the rows whose ``wide_ptr`` flag is 0 are skipped. The words start at 0
    (``kept_bitmaps``; with WIDE_ONLY a skipped row's held word alone)."""
    row = tl.program_id(0)
    if WIDE_ONLY:
        if tl.load(wide_ptr + row) == 0:
            return
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ids = tl.load(kept_ids_ptr + row * stride_ids + offs, mask=offs < K, other=-1)
    valid = (ids >= 0) & (ids < V)
    bit = tl.full((BLOCK_K,), 1, tl.int32) << (ids & 31).to(tl.int32)
    bits_row = bits_ptr + row * stride_bits
    tl.atomic_or(bits_row + (ids >> 5), bit, mask=valid, sem="relaxed")
    if tl.max(valid.to(tl.int32), axis=0) > 0:
        tl.atomic_or(bits_row + held_word, 1, sem="relaxed")


@triton.jit
def _clear_wide_rows_kernel(bits_ptr, wide_ptr, words, stride_bits, BLOCK: tl.constexpr):
    """A wide row's bitmap words zeroed; a narrow one's held word alone (its sums come from its gathers: a tile that
    reads its other words, beside a wide row, sums what they hold and the merge sets the row aside)."""
    row = tl.program_id(0)
    row_ptr = bits_ptr + row * stride_bits
    if tl.load(wide_ptr + row) == 0:
        tl.store(row_ptr + words - 1, 0)
    else:
        for w0 in range(0, words, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            tl.store(row_ptr + offs, tl.zeros((BLOCK,), tl.int32), mask=offs < words)


@triton.jit
def _tile_records_kernel(
    hidden,
    weight,
    bias_ptr,
    targets_ptr,
    parts_ptr,
    target_logit_ptr,
    row_count_ptr,
    candidates_ptr,
    kept_bits_ptr,
    lora_hidden_ptr,
    lora_weight_ptr,
    N,
    V,
    D,
    R,
    row0,
    stride_hn,
    stride_wv,
    stride_field,
    stride_candidate_field,
    stride_kept_row,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    HAS_ROW_COUNT: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TILES: tl.constexpr,
    GROUP_N: tl.constexpr,
    CANDIDATES: tl.constexpr,
    CANDIDATE_COLUMNS: tl.constexpr,
    KEPT_BITS: tl.constexpr,
):
    patches = tl.cdiv(V, TILES * BLOCK_V)
    pid = tl.program_id(0)
    pid_n, patch = tl.swizzle2d(pid // patches, pid % patches, tl.cdiv(N, BLOCK_N), patches, GROUP_N)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    v_lo = patch * TILES * BLOCK_V
    out = parts_ptr + patch * N + offs_n
    holds_target = n_mask & (targets >= v_lo) & (targets < v_lo + TILES * BLOCK_V)
    # with KEPT_BITS the kept set's partial sum R_k (against the patch's m) follows the plain fields
    kept_out = out + (3 if COMPUTE_ENTROPY else 2) * stride_field
    if HAS_ROW_COUNT:
        # a block of padding rows only (past the scored count, a device value) computes no tile; its record is a
        # certain token at a far logit (patch 0: m = z_y = PADDING_LOGIT, R = 0; the other patches: empty), so
        # lse is finite, logp 0, entropy 0, and a backward's recompute sees p = exp(z - lse) = 0 everywhere
        if row0 + n0 >= tl.load(row_count_ptr):
            first = (patch + tl.zeros((BLOCK_N,), tl.int32)) == 0
            far = tl.full((BLOCK_N,), PADDING_LOGIT, tl.float32)
            nothing = tl.zeros((BLOCK_N,), tl.float32)
            tl.store(out, tl.where(first, far, float("-inf")), mask=n_mask)
            tl.store(out + stride_field, nothing, mask=n_mask)
            if COMPUTE_ENTROPY:
                tl.store(out + 2 * stride_field, nothing, mask=n_mask)
            tl.store(target_logit_ptr + offs_n, far, mask=n_mask & first)
            if KEPT_BITS:
                # no kept entry here: the merge's kept sum holds at most the target (the far logit), finite
                tl.store(kept_out, nothing, mask=n_mask)
            return

    # the running record of the patch, its sums against the pivot: m, or 0 while m is -inf
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_rest = tl.zeros((BLOCK_N,), tl.float32)
    run_zrest = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)
    run_kept_rest = tl.zeros((BLOCK_N,), tl.float32)
    if KEPT_BITS:  # a token block of narrow sets alone (no bitmap: their gathers sum them) skips the epilogue's sums
        held = tl.load(kept_bits_ptr + offs_n * stride_kept_row + (V + 31) // 32, mask=n_mask, other=0)
        block_wide = tl.max(held, axis=0) != 0
    for t in range(TILES):
        v0 = v_lo + t * BLOCK_V
        if v0 < V:
            z, _ = logit_tile_at(
                hidden,
                weight,
                bias_ptr,
                lora_hidden_ptr,
                lora_weight_ptr,
                n0,
                v0,
                N,
                V,
                D,
                R,
                stride_hn,
                stride_wv,
                inv_temperature,
                logit_scale,
                softcap,
                HAS_BIAS,
                HAS_LORA,
                HAS_SOFTCAP,
                USE_TMA,
                DOT_FP32,
                DOT_PRECISION,
                LORA_DOT_PRECISION,
                BLOCK_N,
                BLOCK_V,
                BLOCK_D,
                BLOCK_R,
            )
            offs_v = v0 + tl.arange(0, BLOCK_V)
            is_target = offs_v[None, :] == targets[:, None]
            if CANDIDATES > 0:
                top1, top2, top3, top4 = _tile_candidates(z)
                if CANDIDATE_COLUMNS:  # stored here, before the exponentials are live (the bias's tile spilled after)
                    columns = _tile_columns(z, top1, top2, top3).to(tl.float32, bitcast=True)
                    listed = candidates_ptr + (patch * TILES + t) * N + offs_n
                    tl.store(listed + 4 * stride_candidate_field, columns, mask=n_mask)
                new_max = tl.maximum(run_max, top1)
            else:
                new_max = tl.maximum(run_max, tl.max(z, axis=1))
            # a row whose logits so far are all -inf (a bias that masks the vocab) keeps a finite pivot: no inf - inf
            pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(run_max - pivot)
            e = tl.where(is_target, 0.0, tl.exp(z - pivot[:, None]))
            if COMPUTE_ENTROPY:
                # against the new pivot: (Zr + (m_old - m_new) R) rescale; e is 0 where z is -inf: those z are
                # zeroed first so that 0 * -inf never forms a NaN
                shift = tl.where(run_max == float("-inf"), 0.0, run_max - pivot)
                run_zrest = (run_zrest + shift * run_rest) * rescale + tl.sum(
                    e * tl.where(z == float("-inf"), 0.0, z - pivot[:, None]), axis=1
                )
            run_rest = run_rest * rescale + tl.sum(e, axis=1)
            if KEPT_BITS:
                if block_wide:
                    run_kept_rest = run_kept_rest * rescale + _kept_tile(
                        e, offs_n, v0, n_mask, V, kept_bits_ptr, stride_kept_row
                    )
            target_logit += tl.sum(tl.where(is_target, z, 0.0), axis=1)
            run_max = new_max
            if CANDIDATES > 0:
                tl.static_assert(CANDIDATES == 3, "the network lists 3 logits a tile and their bound")
                listed = candidates_ptr + (patch * TILES + t) * N + offs_n
                tl.store(listed, top1, mask=n_mask)
                tl.store(listed + stride_candidate_field, top2, mask=n_mask)
                tl.store(listed + 2 * stride_candidate_field, top3, mask=n_mask)
                tl.store(listed + 3 * stride_candidate_field, top4, mask=n_mask)
    tl.store(out, run_max, mask=n_mask)
    tl.store(out + stride_field, run_rest, mask=n_mask)
    if COMPUTE_ENTROPY:
        tl.store(out + 2 * stride_field, run_zrest, mask=n_mask)
    if KEPT_BITS:
        tl.store(kept_out, run_kept_rest, mask=n_mask)
    tl.store(target_logit_ptr + offs_n, target_logit, mask=holds_target)


@triton.jit
def _merge_parts_kernel(
    parts_ptr,
    target_logit_ptr,
    targets_ptr,
    record_ptr,
    kept_bits_ptr,
    kept_record_ptr,
    N,
    V,
    patches,
    stride_field,
    stride_record,
    stride_kept_row,
    kept_words_count,
    COMPUTE_ENTROPY: tl.constexpr,
    KEPT_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each row's partials folded into softmax_stats.SoftmaxStats's five fields (the module docstring's merge); with
    KEPT_BITS the kept set's partial sums too (against the same pivots), into (the target's logit, -inf where the
    set lacks it; kept_lse; kept_nontarget_mass; 1 where these serve, 0 where the caller recomputes the row) at
    ``kept_record_ptr``; ``kept_words_count``: a bitmap row's words (``kept_words``)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    run_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    run_rest = tl.zeros((BLOCK,), tl.float32)
    run_zrest = tl.zeros((BLOCK,), tl.float32)
    run_kept_rest = tl.zeros((BLOCK,), tl.float32)
    for k in range(patches):
        part = parts_ptr + k * N + offs
        part_max = tl.load(part, mask=mask, other=float("-inf"))
        part_rest = tl.load(part + stride_field, mask=mask, other=0.0)
        new_max = tl.maximum(run_max, part_max)
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        scale_run = tl.exp(run_max - pivot)
        scale_part = tl.exp(part_max - pivot)
        if COMPUTE_ENTROPY:
            part_zrest = tl.load(part + 2 * stride_field, mask=mask, other=0.0)
            # an empty record adds nothing (its sums are 0, and -inf * 0 must not form a NaN)
            shift_run = tl.where(run_max == float("-inf"), 0.0, run_max - pivot)
            shift_part = tl.where(part_max == float("-inf"), 0.0, part_max - pivot)
            run_zrest = (run_zrest + shift_run * run_rest) * scale_run + (
                part_zrest + shift_part * part_rest
            ) * scale_part
        run_rest = run_rest * scale_run + part_rest * scale_part
        if KEPT_BITS:  # against the same pivots as the plain sums
            kept_part = tl.load(part + (3 if COMPUTE_ENTROPY else 2) * stride_field, mask=mask, other=0.0)
            run_kept_rest = run_kept_rest * scale_run + kept_part * scale_part
        run_max = new_max
    # a target outside these weight rows (a vocab-parallel shard's) adds nothing: its record keeps z_y = 0, S = R
    targets = tl.load(targets_ptr + offs, mask=mask, other=-1)
    has_target = (targets >= 0) & (targets < V)
    target_logit = tl.where(has_target, tl.load(target_logit_ptr + offs, mask=mask & has_target, other=0.0), 0.0)
    pivot = tl.where(run_max == float("-inf"), 0.0, run_max)
    target_exp = tl.where(has_target, tl.exp(target_logit - pivot), 0.0)
    out = record_ptr + offs
    tl.store(out, run_max, mask=mask)
    tl.store(out + stride_record, run_rest + target_exp, mask=mask)
    tl.store(out + 2 * stride_record, run_rest, mask=mask)
    zsum = tl.zeros((BLOCK,), tl.float32)
    if COMPUTE_ENTROPY:
        zsum = run_zrest + tl.where(has_target, target_exp * (target_logit - pivot), 0.0)
    tl.store(out + 3 * stride_record, zsum, mask=mask)
    tl.store(out + 4 * stride_record, target_logit, mask=mask)
    if KEPT_BITS:
        # the target's own term where its bit is set, against the same pivot M
        kept_target = has_target & _kept_bit(kept_bits_ptr, stride_kept_row, offs, targets, mask & has_target)
        kept_total = run_kept_rest + tl.where(kept_target, target_exp, 0.0)
        kept_out = kept_record_ptr + offs
        tl.store(kept_out, tl.where(kept_target, target_logit, float("-inf")), mask=mask)
        # an empty set: kept_lse = -inf (the support then NaN: its target is not in it), its mass 0, not 0 / 0
        nonempty = kept_total > 0
        divisor = tl.where(nonempty, kept_total, 1.0)
        tl.store(kept_out + stride_record, tl.where(nonempty, pivot + tl.log(divisor), float("-inf")), mask=mask)
        tl.store(kept_out + 2 * stride_record, run_kept_rest / divisor, mask=mask)
        # the sums serve a wide set (its bitmap holds it) whose sum against M is at least exp(-KEPT_RANGE); a
        # narrow or empty one, one below, or NaN, the caller computes from its gathers
        held = tl.load(kept_bits_ptr + offs * stride_kept_row + kept_words_count - 1, mask=mask, other=0) != 0
        served = held & nonempty & (tl.log(divisor) >= -KEPT_RANGE)
        tl.store(kept_out + 3 * stride_record, served.to(tl.float32), mask=mask)


def forward(head, compute_entropy, config, row_count=None):
    """An operands.HeadOperands (hidden [N, D], weight [V, D], targets [N] int, bias, transform, lora: contiguous) ->
    (logp, entropy, softmax_stats.BackwardStats), [N] fp32 each.

    ``config``: a config.TileRecordConfig. Entropy (and the backward's entropy values) are None without
    ``compute_entropy``."""
    return softmax_stats.finish(forward_record(head, compute_entropy, config, row_count), compute_entropy)


def parts_shape(N, V, compute_entropy, config, candidates=0, kept_bits=False):
    """(fields, patches, rows) of one launch's partial records (fp32): 2 fields (m, R) or 3 (Zr with the entropy),
    1 more with ``kept_bits`` (the kept set's R_k), one record a patch of ``config.tiles`` vocabulary tiles, the
    rows a launch takes (their records, with ``candidates`` (``candidate_fields``' count, 0: none) their tiles'
    candidates, with ``kept_bits`` their kept sets' bitmaps: within PARTS_BYTES, a multiple of BLOCK_N, at least one
    block)."""
    patches = triton.cdiv(V, config.block_v * config.tiles)
    fields = (3 if compute_entropy else 2) + (1 if kept_bits else 0)
    row_bytes = fields * patches * 4 + candidates * triton.cdiv(V, config.block_v) * 4
    row_bytes += kept_words(V) * 4 if kept_bits else 0
    rows = PARTS_BYTES // row_bytes // config.block_n * config.block_n
    return fields, patches, min(N, max(config.block_n, rows))


def candidate_fields(columns=False):
    """The fp32 fields of a tile's candidates (``_tile_candidates``): its TILE_CANDIDATES largest logits, then the
    next, the bound of the rest; with ``columns`` their columns (``_tile_columns``' int32 in an fp32 field's bits)."""
    return TILE_CANDIDATES + 1 + (1 if columns else 0)


def kept_words(V):
    """The int32 words of a row's kept-set bitmap: one bit a vocabulary entry, then one word nonzero where the set
    holds any entry (an empty set told from one whose sum underflows)."""
    return triton.cdiv(V, 32) + 1


def kept_bitmaps(kept_ids, V, out, wide_only=False):
    """``out`` [rows, kept_words(V)] int32 (rows' strides free, words contiguous): the rows' kept sets ``kept_ids``
    [rows, K] as bitmaps (``_kept_bits_kernel``; zeroed first), returned; with ``wide_only`` only the rows of more
    than KEPT_GATHERED ids in [0, V): the others' held word 0, their other words left as they were (no tile's sums of
    them are read; ``_clear_wide_rows_kernel``), so a launch of narrow sets writes a word a row."""
    rows, K = kept_ids.shape
    wide = kept_ids
    if wide_only and rows:
        wide = (((kept_ids >= 0) & (kept_ids < V)).sum(-1) > KEPT_GATHERED).to(torch.int32)
        _clear_wide_rows_kernel[(rows,)](out, wide, out.shape[1], out.stride(0), BLOCK=1024)
    else:
        out.zero_()
    if rows and K:
        block_k = min(triton.next_power_of_2(K), 1024)
        _kept_bits_kernel[(rows, triton.cdiv(K, block_k))](
            kept_ids, out, wide, K, V, kept_ids.stride(0), out.stride(0), kept_words(V) - 1,
            WIDE_ONLY=wide_only, BLOCK_K=block_k,
        )  # fmt: skip
    return out


def workspace_bytes(N, V, compute_entropy, config, candidates=0, kept_bits=False):
    """The bytes ``forward_record`` (``kept_record`` with ``kept_bits``) allocates besides the finished outputs: the
    partial records of one launch (and with ``candidates`` fields (``candidate_fields``) its tiles' candidates, with
    ``kept_bits`` its rows' bitmaps), the target logits and the merged record (5 + 1 fields of N fp32)."""
    if N == 0:
        return 0
    fields, patches, rows = parts_shape(N, V, compute_entropy, config, candidates, kept_bits)
    words = kept_words(V) if kept_bits else 0
    return (fields * patches + candidates * triton.cdiv(V, config.block_v) + words) * rows * 4 + 6 * N * 4


@on_first_argument_device
def forward_record(head, compute_entropy, config, row_count=None, tile_candidates=None, candidate_columns=False):
    """The unfinished per-token record (softmax_stats.SoftmaxStats, [N] fp32 fields) over these weight rows (V >= 1);
    ``forward`` finishes it. zsum is 0 without ``compute_entropy``. A target outside [0, V) (a vocab-parallel shard
    that does not hold it) leaves the record's target 0 and its rest equal to its sumexp. ``row_count``: None, or a
    [1] int32 device tensor: rows from it on are padding (zeros, no gradient), and the blocks wholly past it compute
    no tile (their records are placeholders whose finished values are finite: logp 0, entropy 0).

    ``tile_candidates``: None, or a callable of (n0, n1, candidates, record) called once a launch's rows n0:n1 are
    merged: candidates [candidate_fields(), tiles, n1 - n0] fp32 (each vocabulary tile's ``_tile_candidates`` a row:
    its 3 largest logits, ties repeated, then the 4th; the buffer is the next launch's), record [5, n1 - n0] (the
    SoftmaxStats fields of those rows: the plain pass's, bit for bit). No ``row_count`` with it. With
    ``candidate_columns`` the candidates' fifth field is where the tile's entries lie (``_tile_columns``)."""
    if tile_candidates is not None and row_count is not None:
        raise ValueError("forward_record takes tile_candidates or row_count, not both")
    fields = candidate_fields(candidate_columns) if tile_candidates is not None else 0
    return _record_sweep(head, compute_entropy, config, row_count, (tile_candidates, fields), None)[0]


@on_first_argument_device
def kept_record(head, kept_ids, config, row_count=None):
    """(record, kept): the log-prob's record as ``forward_record``'s (no entropy) and, from the same sweep, the
    replayed kept sets' ``kept_ids`` [N, K] (ids in [0, V) or -1; others skipped): kept [4, N] fp32 of the target's
    logit (-inf where its set lacks it), kept_lse = log sum_{v kept} exp(z_v) (-inf: an empty set),
    kept_nontarget_mass = R_kept / S_kept (0: an empty set), and 1 where these serve, 0 where the set's sum against
    the row's max fell below exp(-KEPT_RANGE) (or is NaN): the caller recomputes those rows (a set far below the
    row's max; the module docstring). Each launch's rows' sets as a bitmap (``_kept_bits_kernel``, [rows,
    kept_words(V)] int32 within PARTS_BYTES with the partials), read in the tiles' epilogue: an id twice in a set
    counts once (the gathers count it twice)."""
    return _record_sweep(head, False, config, row_count, (None, 0), kept_ids)


def _record_sweep(head, compute_entropy, config, row_count, listing, kept_ids):
    """(record, kept [4, N] or None): ``forward_record``'s launches (``listing``: its tile_candidates callable and
    their fields, or (None, 0)), with ``kept_ids`` the kept sets' too."""
    tile_candidates, candidate_count = listing
    hidden, weight, targets, bias, transform, lora = head
    N, D = hidden.shape
    V = weight.shape[0]
    record = torch.empty((5, N), dtype=torch.float32, device=hidden.device)
    with_kept = kept_ids is not None
    kept = torch.empty((4, N), dtype=torch.float32, device=hidden.device) if with_kept else None
    if N == 0:
        return softmax_stats.SoftmaxStats(*record.unbind(0)), kept
    with_candidates = tile_candidates is not None
    fields, patches, chunk = parts_shape(N, V, compute_entropy, config, candidate_count, with_kept)
    parts = torch.empty((fields, patches, chunk), dtype=torch.float32, device=hidden.device)
    tiles = triton.cdiv(V, config.block_v) if with_candidates else 0
    candidates = None  # with tile_candidates: one launch's, laid out per launch below
    if with_candidates:
        candidates = torch.empty(candidate_count * tiles * chunk, dtype=torch.float32, device=hidden.device)
    bits = None  # with kept_ids: one launch's bitmaps, rows of kept_words(V) int32
    if with_kept:
        bits = torch.empty((chunk, kept_words(V)), dtype=torch.int32, device=hidden.device)
    target_logit = torch.empty(N, dtype=torch.float32, device=hidden.device)
    use_tma = config.use_tma and tensor_descriptors_fit(hidden, weight)
    w = tile_operand(weight, use_tma, config.block_v, config.block_d)
    inv_temperature, logit_scale, softcap = transform.kernel_scalars()
    for n0 in range(0, N, chunk):
        rows = min(chunk, N - n0)

        def part(x, dim=0):
            """x's rows of this launch (x itself when one launch takes them all: no index of a fake CUDA tensor)."""
            return x if rows == N else x.narrow(dim, n0, rows)  # noqa: B023 (called in this iteration only)

        # the last launch's partials: the first of the buffer's elements, laid out for its rows
        part_rows = parts if rows == chunk else parts.view(-1)[: fields * patches * rows].view(fields, patches, rows)
        # laid out for its rows too: tile t's field f of row n at (f * tiles + t) * rows + n
        candidate_rows = None
        if with_candidates:
            candidate_rows = candidates[: candidate_count * tiles * rows].view(candidate_count, tiles, rows)
        lora_rows = (part(lora[0]), lora[1]) if lora is not None else None
        bit_rows = None
        if with_kept:
            bit_rows = kept_bitmaps(part(kept_ids), V, bits[:rows], wide_only=True)
        _tile_records_kernel[(triton.cdiv(rows, config.block_n) * patches,)](
            tile_operand(part(hidden), use_tma, config.block_n, config.block_d),
            w,
            bias if bias is not None else hidden,
            part(targets),
            part_rows,
            part(target_logit),
            row_count if row_count is not None else targets,
            candidate_rows if with_candidates else targets,
            bit_rows if with_kept else targets,
            N=rows,
            V=V,
            D=D,
            row0=n0,
            stride_hn=hidden.stride(0),
            stride_wv=weight.stride(0),
            stride_field=part_rows.stride(0),
            stride_candidate_field=candidate_rows.stride(0) if with_candidates else 0,
            stride_kept_row=bit_rows.stride(0) if with_kept else 0,
            inv_temperature=inv_temperature,
            logit_scale=logit_scale,
            softcap=softcap,
            **lora_kernel_args(lora_rows, hidden, config),
            HAS_BIAS=bias is not None,
            HAS_SOFTCAP=transform.softcap is not None,
            COMPUTE_ENTROPY=compute_entropy,
            HAS_ROW_COUNT=row_count is not None,
            USE_TMA=use_tma,
            DOT_FP32=config.dot_fp32,
            DOT_PRECISION=config.dot_precision(hidden.dtype),
            BLOCK_N=config.block_n,
            BLOCK_V=config.block_v,
            BLOCK_D=config.block_d,
            TILES=config.tiles,
            GROUP_N=config.group_n,
            CANDIDATES=TILE_CANDIDATES if with_candidates else 0,
            CANDIDATE_COLUMNS=candidate_count > candidate_fields(),
            KEPT_BITS=with_kept,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        merge_block = 128
        _merge_parts_kernel[(triton.cdiv(rows, merge_block),)](
            part_rows,
            part(target_logit),
            part(targets),
            part(record, 1),
            bit_rows if with_kept else targets,
            part(kept, 1) if with_kept else record,
            rows,
            V,
            patches,
            part_rows.stride(0),
            record.stride(0),
            bit_rows.stride(0) if with_kept else 0,
            kept_words(V),
            COMPUTE_ENTROPY=compute_entropy,
            KEPT_BITS=with_kept,
            BLOCK=merge_block,
            num_warps=4,
        )
        if with_candidates:
            tile_candidates(n0, n0 + rows, candidate_rows, part(record, 1))
    return softmax_stats.SoftmaxStats(*record.unbind(0)), kept
