"""The joint attention kernel (see __init__.py): online softmax in base 2, one program per (query tile of
one stream, batch · head); optionally each query row's per-head RMSNorm on load (diffusers' ``RMSNorm``:
x · rsqrt(mean(x²) + eps) rounded to x's dtype, then · weight), once per program."""

import triton
import triton.language as tl


@triton.jit
def _attend(q, acc, m_i, l_i, desc_k, desc_v, b, col, n_keys, qk_scale,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """One query tile's online softmax over the n_keys keys of one stream (its last tile masked)."""
    full = (n_keys // BLOCK_N) * BLOCK_N
    for n in tl.range(0, full, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([b, n, col]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([b, n, col]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    if full < n_keys:
        k = desc_k.load([b, full, col]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, k.T) * qk_scale
        s = tl.where((full + tl.arange(0, BLOCK_N))[None, :] < n_keys, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([b, full, col]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _joint_attention_kernel(
    q_img, k_img, v_img, o_img,  # [batch, image tokens, heads · HEAD_DIM] descriptors
    q_txt, k_txt, v_txt, o_txt,  # [batch, text tokens, heads · HEAD_DIM] descriptors
    n_img, n_txt, heads, qk_scale,  # qk_scale: 1/√d · log2(e)
    wq_img, wq_txt, eps_img, eps_txt,  # NORM_Q: each stream's q RMSNorm weight [HEAD_DIM] and eps
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NORM_Q: tl.constexpr,
    WS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    col = (bh % heads) * HEAD_DIM
    img_tiles = tl.cdiv(n_img, BLOCK_M)
    if pid_m < img_tiles:
        m0 = pid_m * BLOCK_M
        q = q_img.load([b, m0, col]).reshape(BLOCK_M, HEAD_DIM)
        w_ptr, eps = wq_img, eps_img
    else:
        m0 = (pid_m - img_tiles) * BLOCK_M
        q = q_txt.load([b, m0, col]).reshape(BLOCK_M, HEAD_DIM)
        w_ptr, eps = wq_txt, eps_txt
    if NORM_Q:
        x = q.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + tl.arange(0, HEAD_DIM)).to(tl.float32)
        q = ((x * rstd[:, None]).to(q.dtype).to(tl.float32) * w[None, :]).to(q.dtype)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_img, v_img, b, col, n_img, qk_scale, BLOCK_N, HEAD_DIM, WS)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_txt, v_txt, b, col, n_txt, qk_scale, BLOCK_N, HEAD_DIM, WS)
    out = (acc / l_i[:, None]).to(o_img.dtype).reshape(1, BLOCK_M, HEAD_DIM)
    if pid_m < img_tiles:
        o_img.store([b, m0, col], out)
    else:
        o_txt.store([b, m0, col], out)
