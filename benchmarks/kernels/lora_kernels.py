"""Multi-LoRA kernel benchmark (GPU): shrink / expand (segmented and SGMV) against the HBM floor, the torch
per-segment loop and the base projection GEMM, on hidden 3072.

    python benchmarks/kernels/lora_kernels.py --out DIR [--sweep] [--flush read|write] [--batches 4x4608,1x4608]
        [--slices 3,4] [--ranks 16,64]
    python benchmarks/kernels/lora_kernels.py --out DIR --qkv-only [--sweep-gemm]
        [--batches 4x4608] [--slices 3] [--ranks 64,16,0] [--gemm-configs "w8 s3,after"]

Prints markdown tables and writes them as the run's results file (benchmarks/report.py: DIR or
benchmarks/results, lora_kernels_<gpu>_<yyyymm>_<sha>.md + .json); --qkv-only writes lora_qkv_...: only the QKV
target shapes, the fused GEMM+LoRA (scaled bf16 shrink + lora_gemm
with the LoRA iterations in its K loop) against cuBLAS F.linear, every config checked against the torch
reference, and with --sweep-gemm every candidate tile config of lora_gemm (kernels/lora_gemm/op.py SWEEP) and of the scaled shrink (lora_shrink/op.py SCALED_SWEEP).
"% HBM" = (bytes that must move / copy bandwidth measured in the same run) / measured time.
"% roof" uses max(HBM time, FLOPs / measured bf16 matmul rate): at high rank × slices the shrink's
tensor-core work, not its bytes, sets the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the report helper
from report import write_results  # noqa: E402

import ditserve.kernels.lora_gemm.op as gemm_op
import ditserve.kernels.lora_shrink.op as shrink_op
from ditserve.kernels._bench import LoRAProblem, copy_bandwidth, make_problem, matmul_flops
from ditserve.kernels.lora import _lora_linear_addmm, apply_lora, lora_expand, lora_linear, lora_shrink
from ditserve.kernels.lora_expand.op import launch_lora_expand
from ditserve.kernels.lora_expand.reference import lora_expand_ref
from ditserve.kernels.lora_gemm import gluon_op
from ditserve.kernels.lora_gemm.op import launch_lora_gemm
from ditserve.kernels.lora_gemm.reference import lora_gemm_ref
from ditserve.kernels.lora_linear.op import launch_lora_linear
from ditserve.kernels.lora_linear.reference import lora_linear_ref
from ditserve.kernels.lora_shrink.op import launch_lora_shrink
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref, lora_shrink_scaled_ref
from ditserve.kernels.policy import KernelPolicy

BATCHES = {
    "1x4608": [(4608, 0)],
    "4x4608": [(4608, i) for i in range(4)],
    "skew 4608/1024/4608/256": [(4608, 0), (1024, 1), (4608, 2), (256, 3)],
    "8x256": [(256, i) for i in range(8)],
}
SLICES = {3: [3072] * 3, 4: [3072] * 3 + [12288]}
RANKS = (16, 32, 64, 128)
SHRINK_SWEEP = [(16, 128, 4, 4), (32, 64, 4, 4), (32, 128, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3), (64, 128, 8, 3),
                (128, 64, 8, 3), (128, 32, 8, 4)]  # fmt: skip
EXPAND_SWEEP = [
    (32, 128, 4, 2),
    (64, 64, 4, 2),
    (64, 128, 4, 2),
    (64, 256, 8, 2),
    (128, 128, 8, 2),
    (128, 256, 8, 2),
]


def bench_ms(fn, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median")


_FLUSH: dict[str, object] = {}
# How the L2 is emptied before each timed call. "write": a 256 MB memset (what triton.testing.do_bench
# does); its last ~60 MB stay in L2 as dirty lines, so the timed kernel also pays for writing them back
# (≈ 14 µs of HBM time, which a memory-bound kernel of 40 µs feels and a GEMM does not). "read": the
# buffer is summed instead, leaving clean lines; the kernel's own last dirty lines are then written back
# during the next flush, whose time alone (subtracted) does not include them, so they land on the kernel.
FLUSH_MODE = os.environ.get("LORA_BENCH_FLUSH", "write")


def flush_l2() -> None:
    buf = _FLUSH["buf"]
    if FLUSH_MODE == "read":
        _FLUSH["sink"] = buf.view(torch.int64).sum()
    else:
        buf.zero_()


def flush_ms() -> float:
    """GPU ms of one `flush_l2` in the current FLUSH_MODE (timed once per mode)."""
    times = _FLUSH.setdefault("ms", {})
    if FLUSH_MODE not in times:
        _FLUSH.setdefault("buf", torch.ones(256 << 20, dtype=torch.int8, device="cuda"))
        times[FLUSH_MODE] = triton.testing.do_bench_cudagraph(flush_l2, rep=100, return_mode="median")
    return times[FLUSH_MODE]


def graph_ms(fn) -> float:
    """GPU ms per call from CUDA-graph replay (no Python/launch overhead), L2 flushed before every call
    (`flush_l2` inside the graph, timed alone and subtracted)."""
    flush = flush_ms()
    fn()  # compile outside the capture
    torch.cuda.synchronize()

    def flushed():
        flush_l2()
        fn()

    ms = triton.testing.do_bench_cudagraph(flushed, rep=60, return_mode="median")
    return max(ms - flush, 1e-4)


def commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def with_flush(mode: str, fn):
    """fn() with FLUSH_MODE set to mode."""
    global FLUSH_MODE
    old, FLUSH_MODE = FLUSH_MODE, mode
    try:
        return fn()
    finally:
        FLUSH_MODE = old


def measure(p: LoRAProblem, other_flush: str | None = None) -> dict[str, float]:
    """Median ms of every provider on one problem; other_flush: the shrink and the expand timed again with
    that flush mode (shrink_<mode>, expand_<mode>)."""
    m, sizes = p.meta, p.sizes
    s = lora_shrink(p.x, p.a, m)
    seg = (m.seg_start, m.seg_len, m.seg_slot)
    again = {}
    if other_flush:
        again = {
            f"shrink_{other_flush}": with_flush(
                other_flush, lambda: graph_ms(lambda: lora_shrink(p.x, p.a, m))
            ),
            f"expand_{other_flush}": with_flush(
                other_flush, lambda: graph_ms(lambda: lora_expand(p.y, s, p.b, m, sizes))
            ),
        }

    def loop():
        s_ref = lora_shrink_ref(p.x, p.a, *seg, m.slot_rank, m.max_rank)
        lora_expand_ref(p.y, s_ref, p.b, *seg, m.seg_scale, m.slot_rank, sizes)

    return dict(
        shrink=graph_ms(lambda: lora_shrink(p.x, p.a, m)),
        shrink_sgmv=graph_ms(lambda: lora_shrink(p.x, p.a, m, "sgmv")),
        expand=graph_ms(lambda: lora_expand(p.y, s, p.b, m, sizes)),
        expand_sgmv=graph_ms(lambda: lora_expand(p.y, s, p.b, m, sizes, "sgmv")),
        loop=bench_ms(loop, rep=50),
        base=graph_ms(lambda: F.linear(p.x, p.w)),
        apply=graph_ms(lambda: apply_lora(p.y, p.x, p.a, p.b, m, sizes)),
        apply_sgmv=graph_ms(lambda: apply_lora(p.y, p.x, p.a, p.b, m, sizes, "sgmv")),
        addmm=graph_ms(lambda: _lora_linear_addmm(p.x, p.w, None, p.a, p.b, m, sizes)),
        fused=graph_ms(lambda: lora_linear(p.x, p.w, None, p.a, p.b, m, sizes)),
        apply_eager=bench_ms(lambda: apply_lora(p.y, p.x, p.a, p.b, m, sizes)),
        base_eager=bench_ms(lambda: F.linear(p.x, p.w)),
        **again,
    )


def sweep_one(fn, configs, keys) -> tuple[list[str], dict[str, int] | None]:
    """Time fn(config) for each tile config; returns cells and the fastest config."""
    cells, best, best_ms = [], None, float("inf")
    for c in configs:
        cfg = dict(zip(keys, c, strict=True))
        label = "/".join(str(v) for v in c)
        try:
            ms = bench_ms(lambda cfg=cfg: fn(cfg), rep=30)
        except Exception as e:  # out of shared memory / registers
            cells.append(f"{label}: fail ({type(e).__name__})")
            continue
        cells.append(f"{label}: {ms * 1e3:.1f}")
        if ms < best_ms:
            best, best_ms = cfg, ms
    return cells, best


def sweep(lines: list[str], out: str) -> None:
    """Tile sweep of the segmented kernels; the winners become the launchers' configs for the main table.

    Shrink: per (slices, rank tile), the config with the least summed time over 4x4608 and 1x4608.
    Expand: per rank tile, on 4x4608 with QKV outputs."""
    lines += ["", "### Tile sweep (µs, median of do_bench; shrink BLOCK_M/BLOCK_K/warps/stages, "
              "expand BLOCK_M/BLOCK_N/warps/stages)", ""]  # fmt: skip
    shrink_keys = ("BLOCK_M", "BLOCK_K", "num_warps", "num_stages")
    for nsl, sizes in SLICES.items():
        for rank in RANKS:
            totals: dict[str, float] = {}
            cells_all = []
            # the default (configs.choose: TMA and stream-K kernels, the Gluon shrink) competes with the pointer
            # tiles; the winner is reported for tuned_<gpu>.json, the tables are not changed
            for batch in ("4x4608", "1x4608"):
                p = make_problem(BATCHES[batch], rank, sizes)
                m = p.meta
                args = (p.x, p.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
                cells, _ = sweep_one(lambda cfg, args=args: launch_lora_shrink(*args, config=cfg), SHRINK_SWEEP,
                                     shrink_keys)  # fmt: skip
                ms = bench_ms(
                    lambda args=args, al=m.seg_align: launch_lora_shrink(*args, seg_align=al), rep=30
                )
                cells.append(f"tuned: {ms * 1e3:.1f}")
                for c in cells:
                    label, _, val = c.partition(": ")
                    if not val.startswith("fail"):
                        totals[label] = totals.get(label, 0.0) + float(val)
                cells_all.append(f"{batch}: " + "; ".join(cells))
            if totals:
                label = min(totals, key=totals.get)
                lines.append(f"- shrink slices={nsl} rank={rank}: chosen {label} — " + " | ".join(cells_all))
                print(lines[-1], flush=True)
            if nsl == 3:
                p = make_problem(BATCHES["4x4608"], rank, sizes)
                m = p.meta
                s = lora_shrink(p.x, p.a, m)
                seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
                cells, best = sweep_one(
                    lambda cfg, p=p, s=s, seg=seg: launch_lora_expand(p.y, s, p.b, *seg, p.sizes, config=cfg),
                    EXPAND_SWEEP, ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                )  # fmt: skip
                lines.append(f"- expand 4x4608 QKV rank={rank}: chosen {best} — " + "; ".join(cells))
                print(lines[-1], flush=True)
            save(out, lines)
            torch.cuda.empty_cache()


def save(out: str | None, lines: list[str], name: str = "lora_kernels", data=None) -> None:
    """This run's results file (benchmarks/report.py): the table so far, and data (default: the lines)."""
    write_results(name.removesuffix(".md"), "\n".join(lines), lines if data is None else data, out=out,
                  baseline="F.linear (cuBLAS), a torch clone of the same bytes and a bf16 matmul, same run")  # fmt: skip


def cell(ms: float, nbytes: int, flops: int, bw: float, mm: float) -> str:
    t = ms * 1e-3
    hbm = nbytes / bw
    roof = max(hbm, flops / mm)
    return f"{ms * 1e3:.1f} µs · {nbytes / t / 1e9:.0f} GB/s · {100 * hbm / t:.0f}% HBM · {100 * roof / t:.0f}% roof"


QKV_BATCHES = ("4x4608", "1x4608")
QKV_RANKS = (64, 16, 0)  # 0: no LoRA, our GEMM alone against cuBLAS; the targets first (compiles)
TARGETS = {16: 4.0, 64: 8.0}  # % overhead over the base GEMM at 4x4608, QKV


def quick_graph_ms(fn, calls: int = 8, replays: int = 3) -> float:
    """Like graph_ms with fewer calls (the sweep times ~150 kernels): one graph of `calls` × (L2 flush,
    fn), replayed `replays` times, the fastest replay per call minus the flush."""
    flush = flush_ms()
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(calls):
            flush_l2()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return max(min(times) - flush, 1e-4)


def working(fns: dict[str, object]) -> tuple[dict[str, object], list[str]]:
    """(the fns that run once without raising, a `_fail` line for each one that raised): one variant that
    cannot launch (shared memory, a config the kernel refuses) costs its row, not the whole run. The first
    fn (the baseline of the ratios) is not caught."""
    first = next(iter(fns))
    fns[first]()
    ok, failed = {first: fns[first]}, []
    for name, fn in list(fns.items())[1:]:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - any failure of a variant is reported, not fatal
            failed.append(_fail(name, e))
        else:
            ok[name] = fn
    return ok, failed


def interleaved(fns: dict[str, object], rounds: int, gap_s: float = 0.0) -> dict[str, tuple[float, float]]:
    """{name: (median ms, median ratio to the first fn)}: every fn timed once per round, the rounds
    interleaved so clock and thermal drift hit every row alike; ratios are taken within a round. gap_s of
    idle GPU before each timing lets the clocks recover from the previous one. Fns that raise on a first
    call are left out (printed; their rows read "—")."""
    fns, failed = working(fns)
    for line in failed:
        print(line, flush=True)
    times: dict[str, list[float]] = {k: [] for k in fns}
    ratios: dict[str, list[float]] = {k: [] for k in fns}
    first = next(iter(fns))

    def timed(fn):
        if gap_s:
            torch.cuda.synchronize()
            time.sleep(gap_s)
        return quick_graph_ms(fn)

    for _ in range(rounds):
        row = {k: timed(fn) for k, fn in fns.items()}
        for k, ms in row.items():
            times[k].append(ms)
            ratios[k].append(ms / row[first])
    med = statistics.median
    return {k: (med(times[k]), med(ratios[k])) for k in fns}


def _shrink_call(p: LoRAProblem, cfg: dict[str, int] | None = None):
    """The scaled shrink (bf16 scale · s, what lora_gemm reads) of problem p with tile config cfg."""
    m = p.meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot)
    return lambda: launch_lora_shrink(
        p.x, p.a, *seg, m.slot_rank, m.max_rank, config=cfg, seg_scale=m.seg_scale, seg_align=m.seg_align
    )


def _gemm_call(p: LoRAProblem, s: torch.Tensor, cfg: dict[str, int] | None = None):
    """lora_gemm of problem p on the scaled s with tile config cfg, told the batch's segment alignment."""
    m = p.meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    return lambda: launch_lora_gemm(
        p.x, p.w, None, s, p.b, *seg, p.sizes, config=cfg, s_scaled=True, seg_align=m.seg_align
    )


def _fail(name: str, e: Exception) -> str:
    return f"{name}: fail ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"


def _time_checked(name, fn, want, atol, rtol, t0, budget_s):
    """(cell, ms or None, ok): fn's output checked against want (WRONG if not close), then timed."""
    if time.time() - t0 > budget_s:
        return f"{name}: skipped (time budget)", None, False
    try:
        got = fn()
        ok = bool(torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol))
        ms = quick_graph_ms(fn)
    except Exception as e:  # out of shared memory / registers, lowering not supported
        return _fail(name, e), None, False
    return f"{name}: {ms * 1e3:.1f} µs{'' if ok else ' WRONG'}", ms, ok


# the one-kernel lora_linear's shrink knobs (lora_gemm/op.py), on top of the tuned tiles
FUSED_SWEEP: dict[str, dict[str, int]] = {
    "two launches": {"SHRINK_IN": 0},
    "shrink units per slice": {"SHRINK_WIDE": 0},
    "shrink units per slice K 128": {"SHRINK_WIDE": 0, "SHRINK_K": 128, "SHRINK_STAGES": 5},
    "shrink K 64 4 stages": {"SHRINK_K": 64, "SHRINK_STAGES": 4},
    "shrink units of 32 rows 5 stages": {"SHRINK_M": 32, "SHRINK_STAGES": 5},
    "shrink units of 128 rows K 128": {"SHRINK_M": 128, "SHRINK_K": 128, "SHRINK_STAGES": 3},
    # y's TMA store in two [128, 128] pieces instead of one [128, 256] (32 KB less shared memory)
    "store in two pieces": {"TMA_STORE": 2},
}


def qkv_only(args, head: list[str]) -> None:
    """The target shapes only: F.linear (cuBLAS) vs the scaled shrink (bf16 scale · s) + lora_gemm (LoRA
    iterations in the K loop), every config checked against the torch reference (WRONG when not close);
    the fastest correct shrink and GEMM config per shape make the overhead column. With --sweep-gemm every
    SWEEP config of lora_gemm and SCALED_SWEEP of the shrink; the fastest GEMM config over the LoRA
    shapes is printed as the suggested TUNED["large"] entry."""
    t0 = time.time()
    configs: dict[str, dict[str, int] | None] = {"default": None}
    if args.sweep_gemm:
        configs.update(gemm_op.SWEEP)
    if args.gemm_configs:  # keep the configs whose name contains one of the given parts
        parts = args.gemm_configs.split(",")
        configs = {k: v for k, v in configs.items() if k == "default" or any(q in k for q in parts)}
    shrink_cfgs: dict[str, dict[str, int] | None] = {"default": None}
    if args.sweep_gemm:
        shrink_cfgs.update(shrink_op.SCALED_SWEEP)
    lines = list(head) + [
        "lora_gemm and shrink defaults: kernels/lora_gemm/tuned_<gpu>.json, kernels/lora_shrink/tuned_<gpu>.json;"
        " shrink sweep names: BLOCK_M/BLOCK_K/warps/stages",
        "times: CUDA-graph replay, L2 flushed before each call; shrink = lora_shrink(scaled=True) (bf16 "
        "scale · s); gemm/cuBLAS = lora_gemm time / F.linear time; overhead = (best shrink + best lora_gemm "
        "- cuBLAS) / cuBLAS (rank 0: lora_gemm without LoRA vs cuBLAS); 'fp32-s epilogue' = the unscaled "
        "fp32 s with the LoRA term after the K loop (default tiles)",
        "",
    ]
    summary = ["", "| batch | slices | rank | cuBLAS | best shrink | shrink config | best lora_gemm config | "
               "lora_gemm | gemm/cuBLAS | overhead | one-kernel lora_linear (config) | its overhead | target |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    # the one-kernel lora_linear (shrink inside the GEMM launch, default) against its two-launch form
    fused_cfgs: dict[str, dict[str, int] | None] = {"fused default": None}
    if args.sweep_gemm or args.sweep_fused:
        fused_cfgs.update(FUSED_SWEEP)
    if args.fused_configs:
        parts = args.fused_configs.split(",")
        fused_cfgs = {
            k: v for k, v in fused_cfgs.items() if k == "fused default" or any(q in k for q in parts)
        }
    inter = ["", f"Interleaved ({args.rounds} rounds, {args.gap_s:g} s idle before each timing; medians; "
             "+% = median of the per-round ratios to cuBLAS - 1): cuBLAS F.linear, `lora_linear` as the engine "
             "calls it (one launch: the shrink inside lora_gemm where the batch allows), its parts alone (the scaled shrink; lora_gemm on a given s, "
             "default config and the sweep's fastest), and the two-launch form (shrink kernel, then lora_gemm)", "",
             "| batch | slices | rank | cuBLAS | lora_linear | vs cuBLAS | shrink | fastest swept shrink | its time "
             "| vs cuBLAS | lora_gemm | vs cuBLAS | "
             "fastest swept config | its time | vs cuBLAS | two launches | vs cuBLAS | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    extra = [
        "",
        "lora_gemm / lora_linear configs in the same interleaved rounds (--inter-configs, --inter-fused):",
        "",
        "| batch | slices | rank | config | time | vs cuBLAS |",
        "|---|---|---|---|---|---|",
    ]
    totals: dict[str, float] = {}
    shrink_totals: dict[tuple[int, str], float] = {}
    records = []
    print("\n".join(lines), flush=True)
    for batch in args.batches.split(","):
        for nsl in map(int, args.slices.split(",")):
            sizes = SLICES[nsl]
            for rank in map(int, args.ranks.split(",")):
                p = make_problem(BATCHES[batch], max(rank, 16), sizes)
                m = p.meta
                seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
                base = quick_graph_ms(lambda p=p: F.linear(p.x, p.w))
                shrink_cells, shrink, shrink_best = [], 0.0, ""
                if rank:
                    s_want = lora_shrink_scaled_ref(p.x, p.a, *seg[:4], m.seg_scale, m.slot_rank, m.max_rank)
                    shrink = float("inf")
                    for name, cfg in shrink_cfgs.items():
                        cell, ms, ok = _time_checked(
                            name, _shrink_call(p, cfg), s_want, 2e-2, 2e-2, t0, args.budget_s
                        )
                        shrink_cells.append(cell)
                        if ok and ms < shrink:
                            shrink, shrink_best = ms, name
                        if ok and name != "default":
                            key = (nsl, name)
                            shrink_totals[key] = shrink_totals.get(key, 0.0) + ms
                    s = s_want  # the GEMM's input: the reference's bf16 scale · s
                    if shrink == float("inf"):
                        shrink = float("nan")
                else:
                    s = p.x.new_empty((nsl, m.num_tokens, 0))
                want = lora_gemm_ref(p.x, p.w, None, s, p.b, *seg[1:], p.sizes, s_scaled=True)
                cells, best, best_ms = [], None, float("inf")
                for name, cfg in configs.items():
                    cell, ms, ok = _time_checked(
                        name, _gemm_call(p, s, cfg), want, 5e-2, 3e-2, t0, args.budget_s
                    )
                    if ms is not None:
                        cell += f" ({ms / base:.3f}x cuBLAS)"
                    cells.append(cell)
                    if ok:
                        if name != "default" and rank:
                            totals[name] = totals.get(name, 0.0) + ms / base
                        if ms < best_ms:
                            best, best_ms = name, ms
                if rank:
                    s32 = lora_shrink_ref(p.x, p.a, *seg[1:4], m.slot_rank, m.max_rank)

                    def old(p=p, s32=s32, seg=seg):
                        return launch_lora_gemm(p.x, p.w, None, s32, p.b, *seg, p.sizes)

                    cell, ms, ok = _time_checked("fp32-s epilogue", old, want, 5e-2, 3e-2, t0, args.budget_s)
                    cells.append(cell + (f" ({ms / base:.3f}x cuBLAS)" if ms is not None else ""))
                    del s32
                fused_cells, fused_best, fused_ms = [], "", float("nan")
                if rank:
                    want_lin = lora_linear_ref(p.x, p.w, None, p.a, p.b, *seg[1:], m.max_rank, p.sizes)
                    fbest = float("inf")
                    for name, cfg in fused_cfgs.items():

                        def ffn(p=p, seg=seg, cfg=cfg, m=m):
                            if cfg is not None:  # the tuned tiles with this override
                                cfg = {**gemm_op.gemm_config(m.num_tokens, p.w.shape[0]), **cfg}
                            return launch_lora_linear(p.x, p.w, None, p.a, p.b, *seg, m.max_rank, p.sizes,
                                                      m.seg_align, config=cfg)[0]  # fmt: skip

                        cell, ms, ok = _time_checked(name, ffn, want_lin, 5e-2, 3e-2, t0, args.budget_s)
                        fused_cells.append(cell + (f" ({ms / base:.3f}x cuBLAS)" if ms is not None else ""))
                        if ok and ms < fbest:
                            fbest, fused_best = ms, name
                    fused_ms = fbest if fused_best else float("nan")
                    del want_lin
                label = f"{batch} slices={nsl} rank={rank}"
                line = f"- {label}: cuBLAS {base * 1e3:.0f} µs"
                if rank:
                    line += " — shrink: " + "; ".join(shrink_cells)
                line += " — lora_gemm: " + "; ".join(cells)
                if fused_cells:
                    line += " — one-kernel lora_linear: " + "; ".join(fused_cells)
                lines.append(line)
                print(line, flush=True)
                over = 100 * (shrink + best_ms - base) / base if best else float("nan")
                target = (
                    f"≤ {TARGETS[rank]:.0f}%" if batch == "4x4608" and nsl == 3 and rank in TARGETS else ""
                )
                summary.append(
                    f"| {batch} | {nsl} | {rank} | {base * 1e3:.0f} µs | {shrink * 1e3:.1f} µs | {shrink_best} | "
                    f"{best} | {best_ms * 1e3:.0f} µs | {best_ms / base:.3f} | {over:.1f}% | "
                    f"{fused_ms * 1e3:.0f} µs ({fused_best}) | {100 * (fused_ms - base) / base:.1f}% | {target} |"
                )
                records.append(dict(batch=batch, slices=nsl, rank=rank, base_ms=base, shrink_ms=shrink,
                                    shrink_best=shrink_best, shrink_cells=shrink_cells, best=best,
                                    best_ms=best_ms, cells=cells, fused_best=fused_best, fused_ms=fused_ms,
                                    fused_cells=fused_cells))  # fmt: skip
                save(args.out, lines + summary, "lora_qkv")
                if rank and args.rounds:
                    fns = {
                        "cuBLAS": lambda p=p: F.linear(p.x, p.w),
                        "lora_linear": lambda p=p, m=m: lora_linear(p.x, p.w, None, p.a, p.b, m, p.sizes),
                        # the same with the shrink kernel launched first (the engine's path until SHRINK_IN)
                        "two launches": lambda p=p, m=m: lora_linear(
                            p.x, p.w, None, p.a, p.b, m, p.sizes, s=lora_shrink(p.x, p.a, m, scaled=True)
                        ),
                        # its two parts, each on its own: the shrink, and lora_gemm on a given s
                        "shrink": _shrink_call(p),
                        "lora_gemm": _gemm_call(p, s),
                    }
                    if best not in (None, "default"):
                        fns["best lora_gemm"] = _gemm_call(p, s, configs[best])
                    if args.gluon:  # the Gluon GEMM on a given s, and after the shrink kernel
                        gcfg = gemm_op.SWEEP["gluon"]
                        fns["gluon lora_gemm"] = _gemm_call(p, s, gcfg)
                        fns["gluon no LoRA"] = _gemm_call(p, s[:, :, :0], gcfg)
                        fns["lora_linear without Gluon"] = lambda p=p, seg=seg, m=m: launch_lora_linear(
                            p.x,
                            p.w,
                            None,
                            p.a,
                            p.b,
                            *seg,
                            m.max_rank,
                            p.sizes,
                            m.seg_align,
                            policy=KernelPolicy(gluon=False),
                        )
                        fns["lora_gemm no LoRA"] = _gemm_call(p, s[:, :, :0])
                        # the shrink inside the Gluon launch (the engine's path on Hopper)
                        fns["gluon lora_linear"] = lambda p=p, seg=seg, m=m: launch_lora_linear(
                            p.x,
                            p.w,
                            None,
                            p.a,
                            p.b,
                            *seg,
                            m.max_rank,
                            p.sizes,
                            m.seg_align,
                            policy=KernelPolicy(gluon=True),
                        )
                        # the same with its units all first (SPREAD 0), or spread whatever their width (2), or
                        # with the rank-16 LoRA MMA as a ring step (FOLD 0)
                        variants = {
                            "units first": dict(SPREAD=0),
                            "spread": dict(SPREAD=2),
                            "no fold": dict(FOLD=0),
                            # y stored as the whole tile at once (the default: four column chunks)
                            "e1": dict(EPI_SPLIT=1, EPI_BUFS=1),
                            # tiles waiting for s before their K steps, units due 2 tiles before their group (the
                            # default before LATE); LATE with the units due 1 or 2 tiles before their group
                            "no late lead2": dict(LATE=0, LEAD=2),
                            "late lead1": dict(LATE=1, LEAD=1),
                            "late lead2": dict(LATE=1, LEAD=2),
                            # every unit whole (the default before UNIT_HALVES)
                            "whole units": dict(UNIT_HALVES=0),
                            # every tile's y stored at its end (the default before DEFER)
                            "no defer": dict(DEFER=0),
                        }
                        for name, over in variants.items():
                            fns[f"gluon lora_linear {name}"] = (
                                lambda p=p, m=m, cfg={**gluon_op.GLUON_CONFIG, **over}: gluon_op.launch_gluon_lora_linear(
                                    p.x, p.w, None, p.a, p.b, m.token_seg, m.seg_slot, m.seg_scale, m.slot_rank,
                                    m.max_rank, p.sizes, cfg,
                                )
                            )  # fmt: skip
                            # the shrink kernel and the Gluon GEMM likewise
                            if name.startswith(("e", "no defer")):
                                gv = {**gcfg, **{f"GLUON_{k}": v for k, v in over.items()}}
                                fns[f"gluon two launches {name}"] = lambda p=p, m=m, seg=seg, gv=gv: launch_lora_gemm(
                                    p.x, p.w, None, lora_shrink(p.x, p.a, m, scaled=True), p.b, *seg, p.sizes,
                                    config=gv, s_scaled=True, seg_align=m.seg_align,
                                )  # fmt: skip
                        fns["gluon lora_gemm no fold"] = _gemm_call(p, s, gemm_op.SWEEP["gluon no fold"])
                        nosplit = gemm_op.SWEEP["gluon no split"]
                        fns["gluon lora_gemm no split"] = _gemm_call(p, s, nosplit)
                        fns["gluon no LoRA no split"] = _gemm_call(p, s[:, :, :0], nosplit)
                        # the Gluon shrink kernel alone, and before the Gluon GEMM
                        gshrink = _shrink_call(p, shrink_op.SCALED_SWEEP["gluon"])
                        fns["gluon shrink"] = gshrink
                        fns["gluon two launches gluon shrink"] = lambda p=p, seg=seg, gshrink=gshrink, gcfg=gcfg: (
                            launch_lora_gemm(p.x, p.w, None, gshrink(), p.b, *seg, p.sizes, config=gcfg,
                                             s_scaled=True, seg_align=p.meta.seg_align)
                        )  # fmt: skip
                        fns["gluon two launches"] = lambda p=p, m=m, seg=seg, gcfg=gcfg: launch_lora_gemm(
                            p.x,
                            p.w,
                            None,
                            lora_shrink(p.x, p.a, m, scaled=True),
                            p.b,
                            *seg,
                            p.sizes,
                            config=gcfg,
                            s_scaled=True,
                            seg_align=m.seg_align,
                        )
                    for name in filter(None, args.inter_configs.split(",")):
                        fns[f"gemm {name}"] = _gemm_call(p, s, gemm_op.SWEEP[name])
                        if name.startswith("gluon"):  # and without LoRA (the base loop alone)
                            fns[f"gemm {name} no LoRA"] = _gemm_call(p, s[:, :, :0], gemm_op.SWEEP[name])
                    for name in filter(None, args.inter_fused.split(",")):
                        cfg = {**gemm_op.gemm_config(m.num_tokens, p.w.shape[0]), **FUSED_SWEEP[name]}
                        fns[f"fused {name}"] = lambda p=p, seg=seg, m=m, cfg=cfg: launch_lora_linear(
                            p.x, p.w, None, p.a, p.b, *seg, m.max_rank, p.sizes, m.seg_align, config=cfg
                        )
                    if shrink_best not in ("", "default"):
                        fns["best shrink"] = _shrink_call(p, shrink_cfgs[shrink_best])
                    if args.inter_only:  # cuBLAS (the reference of every ratio) and the shrink stay
                        keep = {"cuBLAS", "shrink", *args.inter_only.split(",")}
                        fns = {k: v for k, v in fns.items() if k in keep}
                    res = interleaved(fns, args.rounds, args.gap_s)

                    def col(name, res=res):
                        if name not in res:
                            return "— | —"
                        return f"{res[name][0] * 1e3:.0f} µs | {100 * (res[name][1] - 1):+.1f}%"

                    inter.append(
                        f"| {batch} | {nsl} | {rank} | {res['cuBLAS'][0] * 1e3:.0f} µs | {col('lora_linear')} | "
                        f"{res['shrink'][0] * 1e3:.1f} µs | {shrink_best} | {col('best shrink')} | {col('lora_gemm')} | {best} | {col('best lora_gemm')} | "
                        f"{col('two launches')} | {target} |"
                    )
                    records[-1]["interleaved"] = res
                    for name in filter(None, args.inter_configs.split(",")):
                        extra.append(f"| {batch} | {nsl} | {rank} | {name} | {col('gemm ' + name)} |")
                        if name.startswith("gluon"):
                            extra.append(
                                f"| {batch} | {nsl} | {rank} | {name} no LoRA | {col(f'gemm {name} no LoRA')} |"
                            )
                    if args.gluon:
                        for name in (
                            "gluon lora_gemm",
                            "gluon lora_linear",
                            "gluon lora_linear units first",
                            "gluon lora_linear spread",
                            "gluon lora_linear no fold",
                            "gluon lora_linear e1",
                            "gluon lora_linear no late lead2",
                            "gluon lora_linear late lead1",
                            "gluon lora_linear late lead2",
                            "gluon lora_linear whole units",
                            "gluon lora_linear no defer",
                            "gluon two launches no defer",
                            "gluon two launches e1",
                            "gluon lora_gemm no fold",
                            "gluon lora_gemm no split",
                            "gluon two launches",
                            "gluon shrink",
                            "gluon two launches gluon shrink",
                            "gluon no LoRA",
                            "gluon no LoRA no split",
                            "lora_gemm no LoRA",
                            "lora_linear without Gluon",
                        ):
                            extra.append(f"| {batch} | {nsl} | {rank} | {name} | {col(name)} |")
                    for name in filter(None, args.inter_fused.split(",")):
                        extra.append(
                            f"| {batch} | {nsl} | {rank} | lora_linear {name} | {col('fused ' + name)} |"
                        )
                    # the rounds so far, in case a later shape runs past a time limit
                    save(args.out, lines + summary + inter + extra, "lora_qkv")
                del p, s, want
                torch.cuda.empty_cache()
    if totals:
        pick = min(totals, key=totals.get)
        n = sum(1 for r in records if r["rank"])
        summary.append(f"\nfastest lora_gemm config over the LoRA shapes (mean gemm/cuBLAS "
                       f"{totals[pick] / max(n, 1):.3f}): {pick} = {configs[pick]}")  # fmt: skip
    for nsl in SLICES:
        cands = {name: t for (k, name), t in shrink_totals.items() if k == nsl}
        if cands:
            pick = min(cands, key=cands.get)
            summary.append(f"fastest shrink config, {nsl} slices (summed over batches and ranks): {pick}")
    if args.rounds:
        summary += inter
        if args.inter_configs or args.inter_fused or args.gluon:
            summary += extra
    summary.append(f"\nwall time {time.time() - t0:.0f} s")
    print("\n".join(summary), flush=True)
    save(args.out, lines + summary, "lora_qkv", dict(head=head, records=records))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--qkv-only", action="store_true", help="only the QKV target shapes, fused GEMM vs cuBLAS"
    )
    ap.add_argument("--sweep-gemm", action="store_true", help="with --qkv-only: every lora_gemm SWEEP config")
    ap.add_argument(
        "--gluon",
        action="store_true",
        help="--qkv-only --rounds: the Gluon lora_gemm (Hopper) "
        "alone and after the shrink kernel, in the interleaved rounds",
    )
    ap.add_argument("--sweep-fused", action="store_true", help="with --qkv-only: every one-kernel lora_linear "
                    "SWEEP config (lora_linear/op.py), without the lora_gemm and shrink sweeps")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="--qkv-only: interleaved rounds of cuBLAS, "
                    "lora_linear and the one-kernel lora_linear per LoRA shape (0: none)")  # fmt: skip
    ap.add_argument("--gap-s", type=float, default=0.0, help="--rounds: seconds of idle GPU before each "
                    "interleaved timing")  # fmt: skip
    ap.add_argument("--fused-configs", default="", help="--sweep-fused: only FUSED_SWEEP names "
                    "containing one of these comma-separated parts")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=115.0, help="--qkv-only: skip configs after this")
    ap.add_argument("--batches", default=None, help="batches to run (comma-separated BATCHES names; "
                    f"--qkv-only: {','.join(QKV_BATCHES)} unless given, else all)")  # fmt: skip
    ap.add_argument("--slices", default=",".join(map(str, SLICES)), help="slice counts to run")
    ap.add_argument("--ranks", default=None, help=f"ranks to run (--qkv-only: {QKV_RANKS} unless given, "
                    f"else {RANKS})")  # fmt: skip
    ap.add_argument("--flush", default="read", choices=["read", "write"], help="the kernel table's L2 flush "
                    "(FLUSH_MODE); the shrink and expand are timed with the other one as well")  # fmt: skip
    ap.add_argument(
        "--inter-configs",
        default="",
        help="--qkv-only: lora_gemm SWEEP names (comma-separated, "
        "exact) also timed in the interleaved rounds",
    )
    ap.add_argument("--inter-fused", default="", help="--qkv-only: FUSED_SWEEP names (comma-separated, exact) "
                    "of the one-kernel lora_linear also timed in the interleaved rounds")  # fmt: skip
    ap.add_argument("--inter-only", default="", help="--qkv-only: time only these rows (comma-separated, "
                    "exact names of the interleaved tables) beside cuBLAS and the shrink")  # fmt: skip
    ap.add_argument("--gemm-configs", default="", help="--qkv-only --sweep-gemm: only SWEEP names containing "
                    "one of these comma-separated parts")  # fmt: skip
    args = ap.parse_args()
    if args.batches is None:
        args.batches = ",".join(QKV_BATCHES if args.qkv_only else BATCHES)
    if args.ranks is None:
        args.ranks = ",".join(map(str, QKV_RANKS if args.qkv_only else RANKS))
    unknown = [b for b in args.batches.split(",") if b not in BATCHES]
    if unknown:
        ap.error(f"--batches: unknown {unknown}; known: {list(BATCHES)}")
    # exact names, checked before any timing (a name with a comma in it would be cut in two)
    for flag, names, known in (("--inter-configs", args.inter_configs, gemm_op.SWEEP),
                               ("--inter-fused", args.inter_fused, FUSED_SWEEP)):  # fmt: skip
        unknown = [n for n in filter(None, names.split(",")) if n not in known]
        if unknown:
            ap.error(f"{flag}: unknown {unknown}; known: {sorted(known)}")
    props = torch.cuda.get_device_properties(0)
    if args.qkv_only:
        qkv_only(args, [f"machine: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
                        f"triton {triton.__version__}, commit {commit()}, {time.strftime('%Y-%m-%d')}",
                        "bf16, hidden 3072, 4 adapters one per request (1 for 1x4608), scale 0.5"])  # fmt: skip
        return
    global FLUSH_MODE
    FLUSH_MODE = args.flush
    other = "write" if args.flush == "read" else "read"
    bw, mm = copy_bandwidth(), matmul_flops()
    head = [
        f"machine: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}, commit {commit()}, {time.strftime('%Y-%m-%d')}",
        f"copy bandwidth (torch clone, read+write): {bw / 1e9:.0f} GB/s; bf16 matmul 8192³: {mm / 1e12:.0f} TFLOP/s",
        "bf16, hidden 3072, per-slot rank = rank, scale 0.5, adapters = one per request (slots 0..n-1)",
        "kernel and GEMM times: CUDA-graph replay, L2 flushed before each call (GPU time, no launch overhead); "
        "torch loop and the last column: eager do_bench (Python + launch overhead included)",
        f"L2 flush: {args.flush} (read: a 256 MB buffer summed, clean lines left; write: memset, ~60 MB of dirty "
        f"lines left that the timed kernel writes back); last column: shrink / expand µs with the {other} flush",
    ]
    sweep_lines: list[str] = []
    if args.sweep:
        sweep(sweep_lines, args.out)
    lines = list(head)
    lines += [
        "",
        "| batch | slices | rank | shrink | shrink SGMV | expand | expand SGMV | torch loop (shrink+expand) | "
        "base GEMM | LoRA overhead: shrink+expand / SGMV / expand-writes+addmm | "
        f"fused GEMM+LoRA: (shrink + lora_gemm - base)/base | eager: shrink+expand vs base | {other} flush: "
        "shrink / expand |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    records = []
    for batch in args.batches.split(","):
        reqs = BATCHES[batch]
        for nsl in map(int, args.slices.split(",")):
            sizes = SLICES[nsl]
            for rank in map(int, args.ranks.split(",")):
                p = make_problem(reqs, rank, sizes)
                m = p.meta
                t = measure(p, other)
                sb, eb = p.shrink_bytes(), p.expand_bytes()
                sf, ef = p.shrink_flops(), p.expand_flops()
                over = [100 * t["apply"] / t["base"], 100 * t["apply_sgmv"] / t["base"],
                        100 * (t["addmm"] - t["base"]) / t["base"], 100 * (t["fused"] - t["base"]) / t["base"]]  # fmt: skip
                row = (
                    f"| {batch} ({m.num_tokens} tok) | {nsl} | {rank} | {cell(t['shrink'], sb, sf, bw, mm)} | "
                    f"{cell(t['shrink_sgmv'], sb, sf, bw, mm)} | {cell(t['expand'], eb, ef, bw, mm)} | "
                    f"{cell(t['expand_sgmv'], eb, ef, bw, mm)} | {t['loop'] * 1e3:.0f} µs | {t['base'] * 1e3:.0f} µs | "
                    f"{over[0]:.1f}% / {over[1]:.1f}% / {over[2]:.1f}% | {over[3]:.1f}% | "
                    f"{t['apply_eager'] * 1e3:.0f} / {t['base_eager'] * 1e3:.0f} µs | "
                    f"{t['shrink_' + other] * 1e3:.1f} / {t['expand_' + other] * 1e3:.1f} µs |"
                )
                lines.append(row)
                print(row, flush=True)
                save(args.out, lines)
                records.append(dict(batch=batch, num_tokens=m.num_tokens, slices=nsl, rank=rank, ms=t,
                                    shrink_bytes=sb, expand_bytes=eb, shrink_flops=sf, expand_flops=ef))  # fmt: skip
                del p
                torch.cuda.empty_cache()
    lines += sweep_lines
    save(
        args.out,
        lines,
        "lora_kernels",
        dict(head=head, flush=args.flush, copy_bw=bw, matmul_flops=mm, records=records),
    )


if __name__ == "__main__":
    main()
