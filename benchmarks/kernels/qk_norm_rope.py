"""Wan's q/k RMSNorm + rotary (GPU): diffusers' ops under torch.compile (its strided-store rotary, what the
baseline runs), our reference's ops under torch.compile, and the one-pass kernel (`kernels/qk_norm_rope`,
what ``--fused-epilogues`` runs), against the HBM floor.

    python benchmarks/kernels/qk_norm_rope.py --out DIR [--rounds 7] [--gap-s 0.25]

Wan: x [1, tokens, 5120] bf16 (Wan 14B: 40 heads × 128), a weight [5120], tables [1, tokens, 1, 128] fp32;
tokens 14040 (832×480, 33 frames) and 18900 (1280×720, 81 frames, one of 4 sequence shards). Timed in
interleaved rounds (lora_kernels.interleaved: CUDA-graph replays, L2 emptied before each call); ratios to the
first row. The floor: x read once and y written once at the copy bandwidth measured in the same run. Every
row is checked against the fp32 reference first. Qwen-Image: q [1, 4096, 24, 128] with diffusers' per-head
RMSNorm and its complex rotary table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import copy_bandwidth  # noqa: E402
from ditserve.kernels.qk_norm_rope.op import head_qk_norm_rope, launch_qk_norm_rope  # noqa: E402
from ditserve.kernels.qk_norm_rope.reference import qk_norm_rope_ref, rotate_complex  # noqa: E402

HEADS, HEAD_DIM = 40, 128
HIDDEN = HEADS * HEAD_DIM
EPS = 1e-6
SHAPES = {"480p, 33 frames": 14040, "720p, 81 frames / 4": 18900}


def diffusers_style(x, weight, cos, sin):
    """diffusers' Wan processor: RMSNorm over the hidden, heads, then strided stores of the turned pairs."""
    q = F.rms_norm(x, (HIDDEN,), weight, EPS).unflatten(2, (HEADS, -1))
    x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(q)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(q)


def record(
    title: str, name: str, tokens: int, x, res: dict, errors: dict, bw: float, lines: list[str]
) -> dict:
    """One shape's table (appended to ``lines`` and printed) and its record; the floor: x read once and the
    output written once at the copy bandwidth ``bw``."""
    floor_ms = 2 * x.numel() * x.element_size() / bw * 1e3
    lines += [
        "",
        f"### {title}; floor {floor_ms * 1e3:.1f} µs",
        "",
        "| row | µs (median) | vs first row | % of floor | max abs error vs fp32 |",
        "|---|---|---|---|---|",
    ]
    for k, (ms, ratio) in res.items():
        lines.append(
            f"| {k} | {ms * 1e3:.1f} | {ratio:.3f}× | {100 * floor_ms / ms:.0f}% | {errors[k]:.3g} |"
        )
    print("\n".join(lines[-len(res) - 4 :]), flush=True)
    return dict(shape=name, tokens=tokens, res=res, errors=errors, floor_ms=floor_ms)


def run_shape(name: str, tokens: int, args, bw: float, lines: list[str]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(1, tokens, HIDDEN, device="cuda", generator=g) * 3).bfloat16()
    weight = (torch.rand(HIDDEN, device="cuda", generator=g) + 0.5).bfloat16()
    angles = torch.rand(tokens, HEAD_DIM // 2, device="cuda", generator=g) * 6.3
    cos = angles.cos().repeat_interleave(2, -1)[None, :, None]
    sin = angles.sin().repeat_interleave(2, -1)[None, :, None]
    flat = [t.reshape(1, tokens, HEAD_DIM).contiguous() for t in (cos, sin)]
    diff = torch.compile(diffusers_style, fullgraph=True)
    ref = torch.compile(lambda x: qk_norm_rope_ref(x, weight, EPS, *flat), fullgraph=True)
    fns = {
        "diffusers' ops, torch.compile": lambda: diff(x, weight, cos, sin),
        "reference ops (stack), torch.compile": lambda: ref(x),
        "qk_norm_rope kernel": lambda: launch_qk_norm_rope(x, weight, EPS, *flat),
    }
    want = qk_norm_rope_ref(x.float(), weight.float(), EPS, *flat).flatten(-2)
    errors = {k: (fn().reshape(want.shape).float() - want).abs().max().item() for k, fn in fns.items()}
    res = lk.interleaved(fns, args.rounds, args.gap_s)
    return record(f"x [1, {tokens}, {HIDDEN}] ({name})", name, tokens, x, res, errors, bw, lines)


QWEN_HEADS = 24
QWEN_SHAPES = {"Qwen-Image 1024², image stream": 4096}


def run_per_head(name: str, tokens: int, args, bw: float, lines: list[str]) -> dict:
    """Qwen-Image's q: diffusers' per-head RMSNorm and complex rotary compiled, the same with the rotary in
    real arithmetic compiled (rotate_complex), and the kernel."""
    from diffusers.models.normalization import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(1, tokens, QWEN_HEADS, HEAD_DIM, device="cuda", generator=g) * 3).bfloat16()
    norm = RMSNorm(HEAD_DIM, eps=EPS).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    angles = torch.rand(tokens, HEAD_DIM // 2, device="cuda", generator=g) * 6.3
    freqs = torch.polar(torch.ones_like(angles), angles)

    def complex_rotary(x):
        q = torch.view_as_complex(norm(x).float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(q * freqs.unsqueeze(1)).flatten(3).type_as(x)

    diff = torch.compile(complex_rotary)
    real = torch.compile(lambda x: rotate_complex(norm(x), freqs))
    fns = {
        "diffusers' ops (complex), torch.compile": lambda: diff(x),
        "real-arithmetic rotary, torch.compile": lambda: real(x),
        "qk_norm_rope kernel": lambda: head_qk_norm_rope(x, norm, freqs),
    }
    with torch.no_grad():
        want = complex_rotary(x.float()).float()  # fp32 throughout: no roundings
        errors = {k: (fn().float() - want).abs().max().item() for k, fn in fns.items()}
        res = lk.interleaved(fns, args.rounds, args.gap_s)
    title = f"q [1, {tokens}, {QWEN_HEADS}, {HEAD_DIM}] ({name})"
    return record(title, name, tokens, x, res, errors, bw, lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap-s", type=float, default=0.25)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    head = [
        f"machine: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton "
        f"{triton.__version__}, commit {lk.commit()}, {time.strftime('%Y-%m-%d')}, flush {lk.FLUSH_MODE}",
        f"copy bandwidth (torch clone, read + write): {bw / 1e9:.0f} GB/s",
    ]
    print("\n".join(head), flush=True)
    lines = list(head)
    records = [run_shape(name, t, args, bw, lines) for name, t in SHAPES.items()]
    records += [run_per_head(name, t, args, bw, lines) for name, t in QWEN_SHAPES.items()]
    lk.save(args.out, lines, "qk_norm_rope", dict(head=head, records=records))


if __name__ == "__main__":
    main()
