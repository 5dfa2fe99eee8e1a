"""The whole LoRA linear in one persistent kernel: base GEMM, segmented shrink and expand.

    y[t, n] = x[t] · W[n] (+ bias[n]) + scale(t) · (x[t] · A[j(n), slot(t)]ᵀ) · B[slot(t), n]ᵀ

`lora_linear` (the engine's path) runs the shrink as its own kernel, which reads x from HBM once more, and
then `lora_gemm`. Here the shrink runs inside the GEMM's launch, on the programs that would otherwise idle
in the last round of tiles:

- Phase 1 (shrink): a persistent grid of P programs over T output tiles gives T mod P programs one tile
  more than the others. The other programs first compute s for whole row blocks of x (every slice at
  once: the A tile of a slot holds the slices side by side, [BLOCK_K, NUM_SLICES·BLOCK_R]), store it
  scaled in x's dtype, and raise the row block's flag (release).
- Phase 2 (GEMM): `lora_gemm`'s persistent grouped tile walk and K loop, with the LoRA iterations at the
  end of the loop (TMA reads of s[j] and B[slot], LORA_IN_LOOP), or without TMA a rank-wide LoRA dot after
  the loop. Until a program has seen every shrink done (a counter, acquire), each tile waits for its row
  block's flag before its K loop and fences the async proxy (the flag's writer stored s through the
  generic proxy; TMA reads through the async one).

Measured on an H200 (BENCHMARKS.md), this was not faster than the shrink kernel + `lora_gemm`: the shrink
phase is not hidden. The engine does not use it; it stays as a measured, tested candidate.

Row blocks whose rows straddle segments (one per request boundary) store each row's own segment's s; their
tiles add the LoRA term segment by segment after the loop (`lora_gemm`'s `_lora_epilogue`).

PHASES selects what one launch does: 3 = both with the flags (GPU), 1 = shrink only, 2 = GEMM only
reading a finished s (two launches: the interpreter runs programs one after another, so a program
waiting for a later one's flag would never return).
"""

import triton
import triton.language as tl

from ditserve.kernels.lora_gemm.kernel import _lora_epilogue, _tile_geometry, _tma_k_tiles


@triton.jit
def _load_x(x, offs_m, m0, kk, num_tokens, hidden, stride_xt, stride_xh, offs_k,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    if USE_TMA:
        xt = x.load([m0, kk])
    else:
        rows = tl.where(offs_m < num_tokens, offs_m, 0).to(tl.int64)
        ptrs = x + rows[:, None] * stride_xt + (kk + offs_k)[None, :] * stride_xh
        if EVEN_K:
            xt = tl.load(ptrs)
        else:
            xt = tl.load(ptrs, mask=(kk + offs_k)[None, :] < hidden, other=0.0)
    return xt


@triton.jit
def _shrink_row_block(
    x, a_ptr, s_ptr, rb, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, seg_scale_ptr,
    slot_rank_ptr, num_tokens, hidden, a_rank_dim, stride_xt, stride_xh, stride_as, stride_al, stride_ar,
    stride_ah, stride_ss, stride_st, stride_sr,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    SHRINK_N: tl.constexpr, SHRINK_CHUNKS: tl.constexpr, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """s[j, rows of row block rb, :BLOCK_R] = scale(t) · x[t] · A[j, slot(t), :rank]ᵀ for every slice j,
    zeros where no adapter applies and past the slot's rank. Columns c of the shrink tile are
    (slice c // BLOCK_R, rank c % BLOCK_R), SHRINK_N at a time."""
    m0 = rb * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    seg_lo = tl.load(token_seg_ptr + m0)
    seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)
    k_tiles = tl.cdiv(hidden, BLOCK_K)
    for ci in tl.static_range(SHRINK_CHUNKS):
        offs_c = ci * SHRINK_N + tl.arange(0, SHRINK_N)
        jc = offs_c // BLOCK_R
        rc = offs_c % BLOCK_R
        out = tl.zeros((BLOCK_M, SHRINK_N), dtype=tl.float32)
        for seg in range(seg_lo, seg_hi + 1):
            slot = tl.load(seg_slot_ptr + seg)
            rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
            rank = tl.minimum(tl.where(slot >= 0, rank, 0), a_rank_dim)
            if rank > 0:
                start = tl.load(seg_start_ptr + seg)
                end = start + tl.load(seg_len_ptr + seg)
                scale = tl.load(seg_scale_ptr + seg)
                col_off = (
                    jc.to(tl.int64) * stride_as
                    + tl.maximum(slot, 0).to(tl.int64) * stride_al
                    + rc * stride_ar
                )
                c_mask = (jc < NUM_SLICES) & (rc < rank)
                acc = tl.zeros((BLOCK_M, SHRINK_N), dtype=tl.float32)
                for ki in range(k_tiles):
                    kk = ki * BLOCK_K
                    xt = _load_x(x, offs_m, m0, kk, num_tokens, hidden, stride_xt, stride_xh, offs_k,
                                 BLOCK_M, BLOCK_K, USE_TMA, EVEN_K)  # fmt: skip
                    at = tl.load(
                        a_ptr + col_off[None, :] + (kk + offs_k)[:, None] * stride_ah,
                        mask=c_mask[None, :] & ((kk + offs_k) < hidden)[:, None],
                        other=0.0,
                    )
                    acc = tl.dot(xt, at, acc, input_precision=PRECISION)
                rows = (offs_m >= start) & (offs_m < end)
                out = tl.where(rows[:, None], acc * scale, out)
        s_ptrs = s_ptr + jc.to(tl.int64)[None, :] * stride_ss + offs_m.to(tl.int64)[:, None] * stride_st
        s_ptrs += rc[None, :] * stride_sr
        tl.store(
            s_ptrs,
            out.to(s_ptr.dtype.element_ty),
            mask=(offs_m < num_tokens)[:, None] & (jc < NUM_SLICES)[None, :],
        )


@triton.jit
def _wait_flag(ptr):
    """Spin until *ptr != 0 (acquire: what its writer stored before raising it is visible after)."""
    while tl.atomic_add(ptr, 0, sem="acquire", scope="gpu") == 0:
        pass


@triton.jit
def _fence_proxy_async(dummy):
    """Generic-proxy writes seen through an acquire become visible to this thread's TMA (async-proxy) reads."""
    return tl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [dummy], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit(do_not_specialize=["blk1", "blk2", "blk3", "num_col_blocks", "num_programs"])
def _lora_linear_kernel(
    x,  # [num_tokens, hidden]: a pointer, or a TensorDescriptor with block [BLOCK_M, BLOCK_K] (USE_TMA)
    w,  # [n_total, hidden]: a pointer, or a TensorDescriptor with block [BLOCK_N, BLOCK_K] (USE_TMA)
    s_desc,  # LORA_IN_LOOP: s viewed as [num_slices·num_tokens, BLOCK_R], block [BLOCK_M, BLOCK_K]
    b_desc,  # LORA_IN_LOOP: B viewed as [max_loras·n_total, lora_k], block [BLOCK_N, BLOCK_K]
    y_ptr,  # [num_tokens, n_total], written once
    bias_ptr,  # [n_total] (read only when HAS_BIAS)
    a_ptr,  # [num_slices, max_loras, a_rank_dim, hidden]
    b_ptr,  # [max_loras, n_total, b_rank_dim]
    s_ptr,  # [num_slices, num_tokens, BLOCK_R] workspace in x's dtype: scale · x · Aᵀ
    sync_ptr,  # [num_row_blocks + 1] int32, zero at launch: one flag per row block, then the done count
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    hidden,
    a_rank_dim,
    b_rank_dim,
    col1,  # first column of slice 1 (= n_total when absent), likewise col2, col3
    col2,
    col3,
    n_total,
    blk1,  # first column block of slice 1 (= num_col_blocks when absent), likewise blk2, blk3
    blk2,
    blk3,
    num_col_blocks,
    num_programs,
    lora_k,  # LORA_IN_LOOP: rank columns the LoRA iterations read (min(BLOCK_R, b_rank_dim))
    s_rows_total,  # rows of s_desc: a row coordinate past every row (TMA reads zeros, moves no bytes)
    b_rows_total,  # rows of b_desc
    stride_xt,
    stride_xh,
    stride_wn,
    stride_wh,
    stride_yt,
    stride_yn,
    stride_as,
    stride_al,
    stride_ar,
    stride_ah,
    stride_bl,
    stride_bn,
    stride_br,
    stride_ss,
    stride_st,
    stride_sr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rank columns of s (power of two ≥ 16, ≥ every slot's rank)
    SHRINK_N: tl.constexpr,  # shrink tile width (≤ NUM_SLICES·BLOCK_R rounded up to a power of two)
    SHRINK_CHUNKS: tl.constexpr,  # shrink tiles per row block: cdiv(NUM_SLICES·BLOCK_R, SHRINK_N)
    GROUP_M: tl.constexpr,
    PHASES: tl.constexpr,  # 1 shrink, 2 GEMM, 3 both (flags)
    LORA_IN_LOOP: tl.constexpr,  # USE_TMA: the LoRA term as the K loop's last iterations (s, B via TMA)
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    EVEN_K: tl.constexpr,
    COL_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_tokens, BLOCK_M)
    num_tiles = num_pid_m * num_col_blocks
    done_ptr = sync_ptr + num_pid_m  # shrunk row blocks so far

    if PHASES & 1:
        # programs without the extra tile of the last round shrink; all of them when the rounds are even
        first = num_tiles % num_programs if PHASES == 3 else 0
        workers = num_programs - first
        rb0 = tl.where(pid >= first, pid - first, num_pid_m)
        for rb in range(rb0, num_pid_m, workers):
            _shrink_row_block(
                x, a_ptr, s_ptr, rb, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, seg_scale_ptr,
                slot_rank_ptr, num_tokens, hidden, a_rank_dim, stride_xt, stride_xh, stride_as, stride_al,
                stride_ar, stride_ah, stride_ss, stride_st, stride_sr,
                NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, SHRINK_N, SHRINK_CHUNKS, USE_TMA, EVEN_K, PRECISION,
            )  # fmt: skip
            if PHASES == 3:
                tl.debug_barrier()  # every thread's s stores precede the release
                tl.atomic_xchg(sync_ptr + rb, 1, sem="release", scope="gpu")
                tl.atomic_add(done_ptr, 1, sem="release", scope="gpu")

    if PHASES & 2:
        k_tiles = tl.cdiv(hidden, BLOCK_K)
        n_iters = k_tiles
        if LORA_IN_LOOP:
            n_iters += tl.cdiv(lora_k, BLOCK_K)
        offs_k = tl.arange(0, BLOCK_K)
        offs_r = tl.arange(0, BLOCK_R)
        all_done = pid < 0  # PHASES=3: every row block is known shrunk (then no tile checks again)
        for tile_id in tl.range(
            pid, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
        ):
            pid_m, j, m0, n0, offs_m, offs_n, n_mask, rows, cols = _tile_geometry(
                tile_id, num_pid_m, num_col_blocks, num_tokens, col1, col2, col3, n_total, blk1, blk2, blk3,
                BLOCK_M, BLOCK_N, GROUP_M, COL_ALIGN,
            )  # fmt: skip

            seg_lo = tl.load(token_seg_ptr + m0)
            seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)
            slot = tl.load(seg_slot_ptr + seg_lo)
            lora_here = (seg_lo == seg_hi) & (slot >= 0)
            slot = tl.maximum(slot, 0)
            if PHASES == 3:
                if all_done == 0:
                    # early tiles: wait for this row block's shrink before the K loop (it may read s)
                    all_done = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu") == num_pid_m
                    if all_done == 0:
                        _wait_flag(sync_ptr + pid_m)
                    if LORA_IN_LOOP:
                        _fence_proxy_async(pid)

            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if USE_TMA:
                # LoRA iterations of other tiles point past the last row: zeros, no bytes moved
                s_row = tl.where(lora_here, j * num_tokens + m0, s_rows_total)
                b_row = tl.where(lora_here, slot * n_total + n0, b_rows_total)
                for ki in range(n_iters):
                    a, wt = _tma_k_tiles(ki, k_tiles, x, w, s_desc, b_desc, m0, n0, s_row, b_row, BLOCK_K,
                                         LORA_IN_LOOP)  # fmt: skip
                    acc = tl.dot(a, wt.T, acc, input_precision=PRECISION)
            else:
                x_ptrs = x + rows[:, None] * stride_xt + offs_k[None, :] * stride_xh
                w_ptrs = w + cols[None, :] * stride_wn + offs_k[:, None] * stride_wh
                for ki in range(k_tiles):
                    kk = ki * BLOCK_K
                    if EVEN_K:
                        a = tl.load(x_ptrs + kk * stride_xh)
                        wt = tl.load(w_ptrs + kk * stride_wh)
                    else:
                        a = tl.load(x_ptrs + kk * stride_xh, mask=(kk + offs_k)[None, :] < hidden, other=0.0)
                        wt = tl.load(w_ptrs + kk * stride_wh, mask=(kk + offs_k)[:, None] < hidden, other=0.0)
                    acc = tl.dot(a, wt, acc, input_precision=PRECISION)

            if lora_here and not LORA_IN_LOOP:
                # the rank-wide LoRA dot after the loop (s and B through pointers: no TMA here)
                s_ptrs = s_ptr + j * stride_ss + rows[:, None] * stride_st + offs_r[None, :] * stride_sr
                b_ptrs = b_ptr + slot.to(tl.int64) * stride_bl + cols[:, None] * stride_bn
                b_ptrs += offs_r[None, :] * stride_br
                st = tl.load(s_ptrs, mask=(offs_m < num_tokens)[:, None], other=0.0)
                bt = tl.load(b_ptrs, mask=n_mask[:, None] & (offs_r < b_rank_dim)[None, :], other=0.0)
                acc = tl.dot(st, bt.T, acc, input_precision=PRECISION)
            elif seg_lo != seg_hi:
                # rare: rows of several segments; each row's s is its own segment's
                acc = _lora_epilogue(
                    acc, seg_lo, seg_hi, j, offs_m, offs_n, n_mask, s_ptr, b_ptr,
                    seg_start_ptr, seg_len_ptr, seg_slot_ptr, seg_scale_ptr, slot_rank_ptr,
                    tl.minimum(BLOCK_R, b_rank_dim), stride_ss, stride_st, stride_sr, stride_bl, stride_bn,
                    stride_br, 16, True, PRECISION,
                )  # fmt: skip
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :] * stride_yn
            tl.store(
                y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < num_tokens)[:, None] & n_mask[None, :]
            )
