"""How far the kernels every row shares (cuBLAS GEMMs, cuDNN attention) are from the GPU's limits on the FLUX.2
and Wan 2.2 shapes, and whether a Triton flash-attention forward (TMA loads, optionally warp-specialised) beats
cuDNN's there:

    python benchmarks/probes/step_floor.py [--only gemm,attention,cross,sd3,libs,layouts,power,drift]

- gemm: each block GEMM of FLUX.2 dev at 1024² and Wan 2.2 A14B at 832×480×33 (bf16, as F.linear runs it),
  TFLOP/s, and the same with PyTorch's TunableOp on (on CUDA builds its only solution is "Default", cuBLAS's
  own choice: any difference is the GPU's state, not another algorithm);
- attention: SDPA's cuDNN and flash backends and the Triton kernel below on the self-attention shapes, TFLOP/s
  (4·B·H·L²·D per call), with the Triton kernel's best config and its largest difference from cuDNN's output;
  cross: the same for Wan's cross-attention (14040 video tokens onto 512 text tokens); sd3: SD3.5's joint
  attention (head_dim 64, 4429 tokens, cfg batch 2);
- libs: each GEMM (with the model's bias where it has one) under cuBLAS and cuBLASLt
  (``torch.backends.cuda.preferred_blas_library``) and TunableOp, timed in alternation, and TunableOp's picks;
- layouts: cuDNN attention with q, k, v as the processors hand them over ([B, L, H, D] transposed) against
  contiguous [B, H, L, D] tensors (and each mix), the output's layout as cuDNN writes it;
- power: the same GEMM for ~15 s with ``nvidia-smi`` sampling power draw, the power limit, SM clock and the
  active clock-event reasons once a second (0x4: the software power cap);
- drift: one GEMM run back to back for ~20 s, its rate in the first and the last seconds (does the GPU slow as
  it warms, so that a row timed later reads slower?).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdpa_backends import timed  # noqa: E402 (CUDA-event median of repeated calls)

from ditserve.kernels.joint_attention.kernel import _attend  # noqa: E402
from ditserve.kernels.joint_attention.op import launch_joint_attention  # noqa: E402
from ditserve.kernels.joint_attention.reference import joint_attention_ref, rms_norm_heads  # noqa: E402

# (name, tokens, in, out): the linears a step runs per block, at batch 1
GEMMS = [
    ("flux2 single qkv+mlp", 4608, 6144, 6144 * 3 + 18432 * 2),
    ("flux2 single out", 4608, 6144 + 18432, 6144),
    ("flux2 double qkv (img)", 4096, 6144, 6144 * 3),
    ("flux2 double ff in (img)", 4096, 6144, 18432 * 2),
    ("flux2 double ff out (img)", 4096, 18432, 6144),
    ("wan qkv/out/q2/o2", 14040, 5120, 5120),
    ("wan ffn in", 14040, 5120, 13824),
    ("wan ffn out", 14040, 13824, 5120),
]
# (name, batch, heads, tokens, head_dim[, key tokens])
ATTENTION = [
    ("flux2 1024²", 1, 48, 4608, 128),
    ("wan 2.2 A14B 832x480x33", 1, 40, 14040, 128),
]
CROSS = [("wan 2.2 A14B cross-attention (512 text tokens)", 1, 40, 14040, 128, 512)]
# SD3.5's joint attention at 1024²: 4096 image + 333 text tokens (77 CLIP + 256 T5), head_dim 64; a guided
# request's two CFG branches as one batch of 2
SD3 = [
    ("sd3.5 large joint, cfg batch 2", 2, 38, 4429, 64),
    ("sd3.5 medium joint, cfg batch 2", 2, 24, 4429, 64),
]


@triton.jit
def _flash_fwd(
    desc_q,
    desc_k,
    desc_v,
    desc_o,
    tokens,
    heads,
    kv_tokens,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WS: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head), over all keys, online softmax in base 2. q, k, v,
    o are [batch, tokens, heads·head_dim] descriptors with [1, rows, head_dim] boxes: rows past ``tokens`` load
    as zeros and are not stored, and the last key tile masks its missing keys."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    col = (bh % heads) * HEAD_DIM
    m0 = pid_m * BLOCK_M
    q = desc_q.load([b, m0, col]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # the key loop of ditserve's joint attention kernel, over one source
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, desc_k, desc_v, b, col, kv_tokens, qk_scale, BLOCK_N, HEAD_DIM, WS
    )
    out = acc / l_i[:, None]
    desc_o.store([b, m0, col], out.to(desc_o.dtype).reshape(1, BLOCK_M, HEAD_DIM))


def joint(shapes) -> dict[str, dict]:
    """SD3's joint attention as a step runs it: from the projections' outputs (the image and text streams'
    fused q|k|v rows, q and k normalised) to the inputs of the two output projections. diffusers: cat, SDPA
    (cuDNN), transpose back, split (copied as the output projection's contiguous input); ditserve's
    ``kernels.joint_attention``, each tile of a sweep (warp-specialised loop or not), with both streams' q
    RMSNorms applied as it loads the queries (as the SD3 processor calls it): one kernel reading both streams
    in place and writing each stream's output. The timed baseline leaves the norms out (compiled, they are
    inductor kernels of their own): the kernel's row carries work the baseline's does not."""
    print("## joint attention, projections' outputs → out-projection inputs (bf16)", flush=True)
    tuned: dict[str, dict] = {}
    for name, b, h, n, d in shapes:
        best = _joint_case(name, b, h, n, d)
        if best is not None and str(d) not in tuned:  # the first (largest) shape of each head_dim
            bm, bn, w, st, ws = best
            tuned[str(d)] = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "WS": ws}
    return tuned


JOINT_TILES = [
    (bm, bn, w, st, ws)
    for ws in (0, 1)
    for bm in (64, 128)
    for bn in (64, 128)
    for w in (4, 8)
    for st in (2, 3)
]


def _joint_case(name: str, b: int, h: int, n: int, d: int) -> tuple | None:
    nt = 333
    ni = n - nt
    hd = h * d
    flops = 4 * b * h * n * n * d
    img_qkv = torch.randn(b, ni, 3 * hd, device="cuda", dtype=torch.bfloat16)
    txt_qkv = torch.randn(b, nt, 3 * hd, device="cuda", dtype=torch.bfloat16)
    img = img_qkv.split(hd, -1)
    txt = txt_qkv.split(hd, -1)

    def stock():
        q, k, v = (
            torch.cat([a, t], 1).unflatten(-1, (h, d)).transpose(1, 2) for a, t in zip(img, txt, strict=True)
        )
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, v)
        o = o.transpose(1, 2).flatten(2)
        return o[:, :ni].contiguous(), o[:, ni:].contiguous()

    ref_i, ref_t = stock()
    qc, kc, vc = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ms = timed(lambda: F.scaled_dot_product_attention(qc, kc, vc))
    print(f"{name} cudnn alone ([B, H, L, D] inputs): {ms:.3f} ms ({flops / ms / 1e9:.0f} TF/s)", flush=True)
    ms = timed(stock)
    print(f"{name} cat + cudnn + split: {ms:.3f} ms ({flops / ms / 1e9:.0f} TF/s of attention)", flush=True)
    # SD3.5's q RMSNorms, applied by the kernel as it loads each query tile (the reference normalises first)
    norms = tuple((torch.rand(d, device="cuda").add(0.5).to(torch.bfloat16), 1e-6) for _ in range(2))
    ref_i, ref_t = (
        o.to(torch.bfloat16)
        for o in joint_attention_ref(
            (rms_norm_heads(img[0], norms[0], d), *img[1:]),
            (rms_norm_heads(txt[0], norms[1], d), *txt[1:]),
            d,
        )
    )
    best = None
    for cfg in JOINT_TILES:  # BLOCK_M, BLOCK_N, num_warps, num_stages, warp-specialised loop
        try:
            oi, ot = launch_joint_attention(img, txt, d, cfg, q_norms=norms)
            err = max((oi.float() - ref_i.float()).abs().max().item(),
                      (ot.float() - ref_t.float()).abs().max().item())  # fmt: skip
            ms = timed(lambda cfg=cfg: launch_joint_attention(img, txt, d, cfg, q_norms=norms), repeats=10)
        except Exception as error:  # noqa: BLE001
            print(f"  joint {cfg}: failed {type(error).__name__}: {str(error)[:120]}", flush=True)
            continue
        print(f"  joint {cfg}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TF/s), max |diff| {err:.4f}", flush=True)
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best:
        print(f"{name} joint triton best: {best[0]:.3f} ms ({flops / best[0] / 1e9:.0f} TF/s) {best[1]}",
              flush=True)  # fmt: skip
    return best[1] if best else None


def triton_attention(q, k, v, cfg: dict) -> torch.Tensor:
    """q, k, v [batch, tokens, heads, head_dim] (the last two contiguous) → out of the same shape."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, n, h, d = q.shape
    out = torch.empty_like(q)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]

    def desc(t, rows):
        return TensorDescriptor(t, [b, t.shape[1], h * d], [t.stride(0), t.stride(1), 1], [1, rows, d])

    grid = (triton.cdiv(n, bm), b * h)
    _flash_fwd[grid](
        desc(q, bm),
        desc(k, bn),
        desc(v, bn),
        desc(out, bm),
        n,
        h,
        k.shape[1],
        (1.0 / math.sqrt(d)) * 1.4426950408889634,
        HEAD_DIM=d,
        BLOCK_M=bm,
        BLOCK_N=bn,
        WS=cfg["WS"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


CONFIGS = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, WS=ws)
    for ws in (False, True)
    for bm in (64, 128)
    for bn in (64, 128)
    for w in (4, 8)
    for s in (2, 3, 4)
    if not (bn == 128 and s == 4) and not (bm == 64 and w == 8)
] + [
    dict(BLOCK_M=256, BLOCK_N=bn, num_warps=w, num_stages=s, WS=False)
    for bn in (64, 128)
    for w in (8, 16)
    for s in (2, 3)
]


def gemms() -> None:
    print("## GEMMs (bf16, F.linear, batch 1)", flush=True)
    rows = []
    for name, m, k, n in GEMMS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ms = timed(lambda x=x, w=w: F.linear(x, w))
        rows.append((name, m, k, n, ms))
        print(f"{name:28s} {m}x{k}x{n}: {ms:.3f} ms, {2 * m * k * n / ms / 1e9:.0f} TF/s", flush=True)
    try:
        import torch.cuda.tunable as tunable

        tunable.enable(True)
        tunable.tuning_enable(True)
        tunable.set_max_tuning_duration(200)
        tunable.set_max_tuning_iterations(100)
        for name, m, k, n in GEMMS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            F.linear(x, w)  # tunes
            ms = timed(lambda x=x, w=w: F.linear(x, w))
            print(f"tunableop {name:28s}: {ms:.3f} ms, {2 * m * k * n / ms / 1e9:.0f} TF/s", flush=True)
        tunable.enable(False)
    except Exception as error:  # noqa: BLE001 (a probe: say what failed and go on)
        print(f"tunableop failed: {type(error).__name__}: {str(error)[:200]}", flush=True)


def attention(shapes=ATTENTION) -> None:
    print("## attention (bf16, [B, L, H, D] as diffusers' processors hand it over)", flush=True)
    for name, b, h, n, d, *kv in shapes:
        nk = kv[0] if kv else n
        q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, nk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * b * h * n * nk * d
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        ref = ref.transpose(1, 2)
        for label, backend in (
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ):

            def call(backend=backend, q=q, k=k, v=v):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    )

            ms = timed(call)
            print(f"{name} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TF/s", flush=True)
        best = None
        for cfg in CONFIGS:
            try:
                out = triton_attention(q, k, v, cfg)
                err = (out.float() - ref.float()).abs().max().item()
                ms = timed(lambda cfg=cfg, q=q, k=k, v=v: triton_attention(q, k, v, cfg), repeats=10)
            except Exception as error:  # noqa: BLE001
                print(f"  triton {cfg}: failed {type(error).__name__}: {str(error)[:160]}", flush=True)
                continue
            print(
                f"  triton {cfg}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TF/s, max |diff| {err:.4f}", flush=True
            )
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best:
            print(
                f"{name} triton best: {best[0]:.3f} ms, {flops / best[0] / 1e9:.0f} TF/s {best[1]}",
                flush=True,
            )


def libs(rounds: int = 3) -> None:
    print("## GEMM libraries, alternated (ms per call)", flush=True)
    import torch.cuda.tunable as tunable

    cases = []
    for name, m, k, n in GEMMS:
        bias = name.startswith("wan")  # Wan's linears carry a bias, FLUX.2's do not
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        cases.append((name, m, k, n, x, w, b))
    times = {}
    for _ in range(rounds):
        for lib in ("cublas", "cublaslt", "tunable"):
            tunable.enable(lib == "tunable")
            tunable.tuning_enable(lib == "tunable")
            torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "cublas")
            for name, _m, _k, _n, x, w, b in cases:
                ms = timed(lambda x=x, w=w, b=b: F.linear(x, w, b))
                times.setdefault((name, lib), []).append(ms)
    tunable.enable(False)
    torch.backends.cuda.preferred_blas_library("default")
    for name, m, k, n, *_ in cases:
        cells = []
        for lib in ("cublas", "cublaslt", "tunable"):
            ms = sorted(times[(name, lib)])[rounds // 2]
            cells.append(f"{lib} {ms:.3f} ({2 * m * k * n / ms / 1e9:.0f} TF/s)")
        print(f"{name:28s} " + "; ".join(cells), flush=True)
    for line in tunable.get_results():
        print("  tunable pick:", line, flush=True)


def layouts() -> None:
    print("## cuDNN attention by input layout", flush=True)
    for name, b, h, n, d in ATTENTION:
        flops = 4 * b * h * n * n * d
        bshd = [
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)
        ]
        bhsd = [t.contiguous() for t in bshd]
        cases = {
            "q,k,v [B,L,H,D]ᵀ": bshd,
            "q,k,v [B,H,L,D]": bhsd,
            "q,k [B,H,L,D], v [B,L,H,D]ᵀ": [bhsd[0], bhsd[1], bshd[2]],
        }
        for label, (q, k, v) in cases.items():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v)
                ms = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
            print(
                f"{name} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TF/s, out strides {out.stride()}",
                flush=True,
            )


def power(seconds: float = 15.0) -> None:
    import subprocess

    print("## power: flux2 single qkv+mlp GEMM back to back, nvidia-smi once a second", flush=True)
    query = "power.draw,power.limit,clocks.sm,clocks.max.sm,temperature.gpu,clocks_throttle_reasons.active"
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv", "-lms", "1000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    name, m, k, n = GEMMS[0]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        ms = timed(lambda: F.linear(x, w), repeats=20)
    print(f"  last: {2 * m * k * n / ms / 1e9:.0f} TF/s", flush=True)
    smi.terminate()
    print(smi.communicate()[0], flush=True)


def drift(seconds: float = 20.0) -> None:
    print("## drift: flux2 single qkv+mlp GEMM back to back", flush=True)
    name, m, k, n = GEMMS[0]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    marks = []
    while time.perf_counter() - start < seconds:
        ms = timed(lambda: F.linear(x, w), repeats=50)
        marks.append((time.perf_counter() - start, 2 * m * k * n / ms / 1e9))
    for t, tf in marks[:3] + marks[-3:]:
        print(f"  t={t:5.1f} s: {tf:.0f} TF/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="gemm,attention,drift")
    ap.add_argument(
        "--tuned",
        help="with sd3: write the joint attention kernel's fastest tile per head_dim to this JSON file "
        "(kernels/joint_attention/tuned_<gpu>.json)",
    )
    args = ap.parse_args()
    only = args.only.split(",")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    if "attention" in only:
        attention()
    if "cross" in only:
        attention(CROSS)
    if "sd3" in only:
        tuned = joint(SD3)
        if args.tuned and tuned:
            about = (
                f"Joint attention tiles per head_dim, the fastest of a sweep at SD3.5's shapes on one "
                f"{torch.cuda.get_device_name()} (python benchmarks/probes/step_floor.py --only sd3 --tuned)."
            )
            Path(args.tuned).write_text(json.dumps({"_about": about, "configs": tuned}, indent=1) + "\n")
            print(f"wrote {args.tuned}: {tuned}", flush=True)
    if "layouts" in only:
        layouts()
    if "libs" in only:
        libs()
    if "power" in only:
        power()
    if "drift" in only:
        drift()
    if "gemm" in only:
        gemms()


if __name__ == "__main__":
    main()
