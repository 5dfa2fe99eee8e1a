"""Whether two checkouts compile the LoRA kernels to the same PTX for sm_90 (no GPU needed).

A refactor that only moves code into @triton.jit helpers (which Triton inlines) or into shared launcher helpers
must leave every kernel the launchers compile unchanged. This probe drives the launchers of both trees over the
same problems and configs and compares the PTX of every compiled kernel, debug info stripped:

    python benchmarks/probes/ptx_same.py --base /tmp/ptx_base --head /work/main [--only shrink,gemm]

Each tree is imported as the `ditserve` package from a folder of its own (a link named ditserve to the tree, the
editable install of the venv switched off), in worker processes (at most --jobs at a time, one family of
launches per process). In a worker `kernel[grid](...)` compiles through `warmup` against an sm_90 target with CPU
tensors, so nothing launches; the tensors are never touched (`torch.empty`), and the launchers see what an H200
shows them (132 SMs, Triton on its tensors), so they pick the configs of the H200 tables. Prints one row per
kernel (configs compiled, same or different) and, for a difference, whether only register numbers / labels differ
(cosmetic), the same lines come in another order (reordered) or instructions differ (real), whether ptxas still
made the same SASS of them (cuobjdump of both cubins), and a short unified diff. Exit status 1 on a difference,
2 when one tree fails a launch the other compiles (or a worker crashes). --compare-only re-reads a --work folder.

--triton-site DIR puts another Triton first on the workers' path (a `pip install --target DIR` of the version the
GPU runs: the Gluon kernels with FOLD need 3.6). Compiled kernels are cached per tree and Triton version under
--cache (Triton's own cache, keyed by source), so a second run against a moved HEAD recompiles only what changed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve()
NUM_SMS = 132  # an H200
HIDDEN = 3072
# token layouts: (tokens, slot) per request; 4 slots, all of the case's rank
LAYOUTS = {
    "1280": [(320, 0), (320, 1), (320, 2), (320, 3)],
    "4x4608": [(4608, 0), (4608, 1), (4608, 2), (4608, 3)],
    "skew": [(4096, 0), (77, 1), (1024, -1), (512, 2), (3, 3)],
}
SLICE_SIZES = {1: [HIDDEN], 3: [HIDDEN] * 3, 4: [HIDDEN] * 3 + [4 * HIDDEN]}  # 4: Flux single block q/k/v/mlp
RANKS = (16, 32, 64, 128)

# Explicit configs beyond the defaults: the variants the launchers can take (same literal dicts for both trees).
SHRINK_VARIANTS = {
    "plain": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4),
    "plain split": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT=1),
    "tma": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=3, TMA=1),
    "tma split": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, SPLIT=1, TMA=1),
    "sk x2": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1, STREAMK=2),
    "sk x3": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1, STREAMK=3),
    "sk 128 x1": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=1, STREAMK=1),
    "wide 128": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=1, STREAMK=1, WIDE=1),
    "wide 64 x2": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1, STREAMK=2, WIDE=1),
}
_ROWS = dict(ROWS=1, BLOCK_M=64, BLOCK_N=128, CHUNK=8, STAGES=3, num_warps=4)
EXPAND_VARIANTS = {
    "tiles 64x128": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    "tiles 128x256": dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=2),
    "rows": dict(_ROWS),
    "rows B tma": dict(_ROWS, B_TMA=1),
    "rows B+y tma": dict(_ROWS, B_TMA=1, Y_TMA=1),
    "rows B+y tma s early": dict(_ROWS, B_TMA=1, Y_TMA=1, S_EARLY=1),
    "rows per-sm chunks": dict(_ROWS, B_TMA=1, Y_TMA=1, S_EARLY=1, PER_SM=2, ALT_CHUNK=24),
}
SGMV_SHRINK_VARIANTS = {
    "split 64/64/4/4": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT=1),
    "split 128/64/8/4": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, SPLIT=1),
    "128/64/8/3": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=3),
}
SGMV_EXPAND_VARIANTS = {
    "tiles 64x128": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    "rows": dict(ROWS=1, BLOCK_M=64, BLOCK_N=128, CHUNK=8, STAGES=3, num_warps=4),
    "rows B tma": dict(ROWS=1, BLOCK_M=128, BLOCK_N=128, CHUNK=12, STAGES=3, num_warps=8, B_TMA=1),
}


def _gemm(bm, bn, bk, warps, stages, persistent=1, tma=0, flatten=0, group_m=8, lora_loop=1, store=0):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages,
                PERSISTENT=persistent, TMA=tma, FLATTEN=flatten, LORA_LOOP=lora_loop, TMA_STORE=store)  # fmt: skip


GEMM_VARIANTS = {
    "ptr 128x128 s4": _gemm(128, 128, 64, 4, 4, persistent=0),
    "ptr persist flat": _gemm(128, 256, 64, 8, 3, flatten=1),
    "tma persist": _gemm(128, 256, 64, 8, 3, tma=1),
    "tma persist flat": _gemm(128, 256, 64, 8, 3, tma=1, flatten=1),
    "tma persist flat g16 tstore": _gemm(128, 256, 64, 8, 3, tma=1, flatten=1, group_m=16, store=1),
    "tma persist tstore2": _gemm(128, 256, 64, 8, 3, tma=1, store=2),
    "tma persist after": _gemm(128, 256, 64, 8, 3, tma=1, lora_loop=2),
    "tma persist flat after": _gemm(128, 256, 64, 8, 3, tma=1, flatten=1, lora_loop=2),
    "tma persist flat epi": _gemm(128, 256, 64, 8, 3, tma=1, flatten=1, lora_loop=0),
    "tma 128x128 not persistent": _gemm(128, 128, 64, 4, 4, persistent=0, tma=1),
}
ADALN_CONFIGS = {
    "32/64/4/2": dict(BLOCK_M=32, BLOCK_K=64, num_warps=4, num_stages=2),
    "32/128/8/2": dict(BLOCK_M=32, BLOCK_K=128, num_warps=8, num_stages=2),
    "64/64/8/2": dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=2),
    "16/256/8/2": dict(BLOCK_M=16, BLOCK_K=256, num_warps=8, num_stages=2),
}
# the Gluon kernels' forms (those tests/kernels/test_gluon_compile.py compiles with Triton 3.9, and with FOLD
# on, which Triton 3.9's Gluon refuses: compared where both trees compile them)
GLUON_SHRINK = [
    (3, 64, 1, {}), (3, 16, 0, {}), (4, 64, 1, {}), (2, 128, 1, {}), (1, 32, 1, {}),
    (4, 16, 0, {"BLOCK_M": 128, "num_warps": 8}), (3, 16, 1, {"BLOCK_K": 128}), (4, 32, 0, {"WG": 3}),
    (3, 64, 1, {"WG": 3}), (3, 32, 0, {"WG": 2}), (4, 32, 1, {"WG": 3, "BLOCK_K": 32}),
]  # fmt: skip
GLUON_EXPAND = [
    (3, 16, {}), (4, 128, {}), (3, 64, {"LAG": 1}), (3, 128, {"BLOCK_N": 128, "LAG": 1}),
    (4, 32, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4}), (3, 128, {"WG": 2, "num_warps": 4, "LAG": 0}),
    (4, 64, {"WG": 2, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "LAG": 1}),
]  # fmt: skip
GLUON_LINEAR = [{"FOLD": 0}, {"FOLD": 0, "EPI_SPLIT": 1, "EPI_BUFS": 1}, {"SPREAD": 0, "FOLD": 0},
                {"FOLD": 0, "UNIT_HALVES": 0}, {}]  # fmt: skip
GLUON_GEMM = [
    (16, {"FOLD": 0, "DEFER": 1}),
    (64, {"FOLD": 0, "DEFER": 1}),
    (16, {"FOLD": 0, "DEFER": 0}),
    (16, {}),
]


def cases() -> dict[str, list[dict]]:
    """Every launch, by family (one worker process per family and tree); plain data, the same for both trees."""
    fam: dict[str, list[dict]] = defaultdict(list)

    def add(family, name, **params):
        fam[family].append(dict(family=family, name=name, **params))

    for lay in LAYOUTS:
        for sl in (1, 3, 4):
            for r in RANKS:
                for scaled in (0, 1):
                    add("shrink", f"shrink default {lay} s{sl} r{r} scaled{scaled}", layout=lay, slices=sl,
                        rank=r, scaled=scaled)  # fmt: skip
                for mode in ("acc", "acc bias", "write bias", "write"):
                    add("expand", f"expand default {lay} s{sl} r{r} {mode}", layout=lay, slices=sl, rank=r,
                        mode=mode)  # fmt: skip
                add(
                    "sgmv",
                    f"shrink_sgmv default {lay} s{sl} r{r}",
                    op="shrink",
                    layout=lay,
                    slices=sl,
                    rank=r,
                )
                add(
                    "sgmv",
                    f"expand_sgmv default {lay} s{sl} r{r}",
                    op="expand",
                    layout=lay,
                    slices=sl,
                    rank=r,
                )
    for lay in ("4x4608", "skew"):
        for sl, r in ((3, 64), (4, 32), (1, 16)):
            for scaled in (0, 1):
                for v, cfg in SHRINK_VARIANTS.items():
                    add("shrink", f"shrink {v} {lay} s{sl} r{r} scaled{scaled}", layout=lay, slices=sl, rank=r,
                        scaled=scaled, config=cfg)  # fmt: skip
            for v, cfg in EXPAND_VARIANTS.items():
                for mode in ("acc", "write bias") if not v.startswith("rows") else ("acc",):
                    add("expand", f"expand {v} {lay} s{sl} r{r} {mode}", layout=lay, slices=sl, rank=r,
                        mode=mode, config=cfg)  # fmt: skip
            for v, cfg in SGMV_SHRINK_VARIANTS.items():
                add("sgmv", f"shrink_sgmv {v} {lay} s{sl} r{r}", op="shrink", layout=lay, slices=sl, rank=r,
                    config=cfg)  # fmt: skip
            for v, cfg in SGMV_EXPAND_VARIANTS.items():
                add("sgmv", f"expand_sgmv {v} {lay} s{sl} r{r}", op="expand", layout=lay, slices=sl, rank=r,
                    config=cfg)  # fmt: skip
    for lay in LAYOUTS:
        for sl in (1, 3, 4):
            for r in (0, 16, 64, 128):
                for s_mode in ("scaled", "fp32") if r else ("none",):
                    for bias in (0, 1):
                        add("gemm", f"gemm default {lay} s{sl} r{r} {s_mode} bias{bias}", layout=lay, slices=sl,
                            rank=r, s_mode=s_mode, bias=bias)  # fmt: skip
            for r in RANKS:
                for bias in (0, 1):
                    add("linear", f"linear default {lay} s{sl} r{r} bias{bias}", layout=lay, slices=sl, rank=r,
                        bias=bias)  # fmt: skip
    for lay in ("4x4608", "skew"):
        for v, cfg in GEMM_VARIANTS.items():
            for s_mode in ("scaled", "fp32"):
                add("gemm", f"gemm {v} {lay} s3 r64 {s_mode} bias1", layout=lay, slices=3, rank=64,
                    s_mode=s_mode, bias=1, config=cfg)  # fmt: skip
    large = GEMM_VARIANTS["tma persist flat g16 tstore"]
    for r in (16, 64):
        add("linear", f"linear two launches 4x4608 s3 r{r} bias0", layout="4x4608", slices=3, rank=r, bias=0,
            config={**large, "SHRINK_IN": 0})  # fmt: skip
        add("linear", f"linear shrink-in not wide 4x4608 s4 r{r} bias1", layout="4x4608", slices=4, rank=r,
            bias=1, config={**large, "SHRINK_WIDE": 0})  # fmt: skip
        add("linear", f"linear shrink-in 64/64/4 4x4608 s3 r{r} bias0", layout="4x4608", slices=3, rank=r,
            bias=0, config={**large, "SHRINK_K": 64, "SHRINK_STAGES": 4})  # fmt: skip
    for tokens in (1024, 18432):
        for dtype in ("bfloat16", "float32"):
            add("adaln", f"adaln default {tokens} {dtype}", tokens=tokens, dtype=dtype)
            for v, cfg in ADALN_CONFIGS.items():
                add("adaln", f"adaln {v} {tokens} {dtype}", tokens=tokens, dtype=dtype, config=cfg)
    for sl, r, scaled, cfg in GLUON_SHRINK:
        add("gluon", f"gluon shrink s{sl} r{r} scaled{scaled} {cfg}", op="shrink", slices=sl, rank=r,
            scaled=scaled, config=cfg)  # fmt: skip
    for sl, r, cfg in GLUON_EXPAND:
        add("gluon", f"gluon expand s{sl} r{r} {cfg}", op="expand", slices=sl, rank=r, config=cfg)
    for cfg in GLUON_LINEAR:
        add("gluon", f"gluon linear r16 {cfg}", op="linear", rank=16, config=cfg)
    for r, cfg in GLUON_GEMM:
        add("gluon", f"gluon gemm r{r} {cfg}", op="gemm", rank=r, config=cfg)
    return dict(fam)


# ----------------------------------------------------------------------------------------------------- worker


def _isolate_tree(link_dir: str) -> None:
    """Import `ditserve` from link_dir only: without the venv's editable install, whose finder would add the
    working tree's folders to the namespace package (a module missing from one tree found in the other)."""
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                        and "__editable__" not in type(f).__module__]  # fmt: skip
    sys.path[:] = [p for p in sys.path if "__editable__" not in p]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
    sys.path_importer_cache.clear()
    sys.path.insert(0, link_dir)


class _Hopper:
    """The active driver: an sm_90 target, CPU tensors."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def _describe(v) -> str:
    """A launch argument as it reaches the compile: dtypes, descriptor boxes, ints' specialisations."""
    import torch

    if isinstance(v, torch.Tensor):
        return f"*{str(v.dtype).removeprefix('torch.')}"
    if type(v).__name__ == "TensorDescriptor":
        base = getattr(v, "base", None)
        dt = str(base.dtype).removeprefix("torch.") if base is not None else "?"
        return f"desc<{dt},{list(getattr(v, 'block_shape', []))}>"
    if isinstance(v, bool):
        return f"b{int(v)}"
    if isinstance(v, int):
        return "i1" if v == 1 else ("i16" if v % 16 == 0 else "i")
    if isinstance(v, float):
        return "f"
    return type(v).__name__


def _keep_cubin(compiled) -> str | None:
    """The kernel's cubin, kept by content under $PTX_SAME_CUBINS (for a SASS comparison where PTX differs)."""
    folder, cubin = os.environ.get("PTX_SAME_CUBINS"), compiled.asm.get("cubin")
    if not folder or not isinstance(cubin, bytes):
        return None
    path = Path(folder) / f"{hashlib.sha1(cubin).hexdigest()}.cubin"
    if not path.exists():
        path.write_bytes(cubin)
    return str(path)


def _install_warmup(records: list) -> None:
    """`kernel[grid](...)` compiles (warmup) and records the kernel; nothing launches."""
    import inspect

    from triton.runtime.jit import KernelInterface

    def getitem(self, grid):
        def launch(*args, **kwargs):
            compiled = self.warmup(*args, grid=grid, **kwargs)
            fn = getattr(self, "fn", None)
            names = list(inspect.signature(fn).parameters) if fn is not None else []
            params = {k: v for k, v in kwargs.items() if k in names}
            options = {k: v for k, v in kwargs.items() if k not in names}
            bound = inspect.signature(fn).bind(*args, **params)
            bound.apply_defaults()
            constexprs, signature = {}, []
            for p in getattr(self, "params", []):
                val = bound.arguments.get(p.name)
                if p.is_constexpr:
                    constexprs[p.name] = (
                        val if isinstance(val, (int, float, str, bool, type(None))) else str(val)
                    )
                else:
                    signature.append(_describe(val))
            records.append(dict(kernel=getattr(fn, "__name__", repr(self)), constexprs=constexprs,
                                options={k: v for k, v in options.items() if isinstance(v, (int, float, str, bool))},
                                signature=signature, ptx=compiled.asm["ptx"], cubin=_keep_cubin(compiled),
                                shared=getattr(compiled.metadata, "shared", None)))  # fmt: skip
            return None

        return launch

    KernelInterface.__getitem__ = getitem


def _worker(link_dir: str, tree: str, case_file: str, out_file: str) -> None:
    _isolate_tree(link_dir)
    import torch
    from triton.runtime import driver

    import ditserve.kernels._dispatch as dispatch

    # what an H200 shows the launchers: Triton runs on its tensors, 132 SMs (before the ops import these by name)
    dispatch.use_triton = lambda t: True
    dispatch.num_programs_limit = lambda device: NUM_SMS
    driver.set_active(_Hopper())
    records: list[dict] = []
    _install_warmup(records)

    from ditserve.kernels.lora_meta import LoRABatchMeta

    specs = json.loads(Path(case_file).read_text())
    results = []
    metas: dict = {}

    def meta(layout: str, rank: int):
        if (layout, rank) not in metas:
            reqs = LAYOUTS[layout]
            metas[layout, rank] = LoRABatchMeta.build(reqs, [rank] * 4, [0.5] * len(reqs), device="cpu")
        return metas[layout, rank]

    bf16 = torch.bfloat16
    for spec in specs:
        start = len(records)
        t0 = time.time()
        try:
            _run_case(spec, meta, bf16)
            err = None
        except Exception as e:  # noqa: BLE001 (a launch that fails in one tree is reported, not fatal)
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        results.append(dict(name=spec["name"], family=spec["family"], error=err,
                            records=records[start:], seconds=round(time.time() - t0, 2)))  # fmt: skip
        print(f"[{Path(tree).name}] {spec['name']}: {len(records) - start} kernel(s)"
              f"{' ERROR ' + err if err else ''} ({time.time() - t0:.1f}s)", file=sys.stderr, flush=True)  # fmt: skip
    # every ditserve module came from this tree
    root = os.path.realpath(tree)
    stray = [m.__name__ for m in list(sys.modules.values()) if m and m.__name__.startswith("ditserve")
             and getattr(m, "__file__", None) and not os.path.realpath(m.__file__).startswith(root + os.sep)]  # fmt: skip
    import triton

    Path(out_file).write_text(
        json.dumps(dict(results=results, stray_modules=stray, triton=triton.__version__))
    )


def _run_case(spec: dict, meta, dt) -> None:
    import torch

    E = torch.empty  # never read: the compile sees dtypes, shapes, strides and 16-byte alignment only
    fam, cfg = spec["family"], spec.get("config")
    cfg = dict(cfg) if cfg is not None else None
    if fam == "adaln":
        from ditserve.kernels.adaln.op import launch_adaln

        dtype = getattr(torch, spec["dtype"])
        x = E(spec["tokens"], HIDDEN, dtype=dtype)
        launch_adaln(x, E(2, HIDDEN, dtype=dtype), E(2, HIDDEN, dtype=dtype), 1e-6, config=cfg)
        return
    if fam == "gluon":
        _run_gluon(spec, cfg)
        return
    sl, r = spec["slices"], spec["rank"]
    m = meta(spec["layout"], max(r, 16))
    t = m.token_seg.shape[0]
    sizes = SLICE_SIZES[sl]
    x = E(t, HIDDEN, dtype=dt)
    a = E(sl, 4, max(r, 16), HIDDEN, dtype=dt)
    b = E(4, sum(sizes), max(r, 16), dtype=dt)
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot)
    if fam == "shrink":
        from ditserve.kernels.lora_shrink.op import launch_lora_shrink

        launch_lora_shrink(x, a, *seg, m.slot_rank, r, config=cfg, seg_scale=m.seg_scale if spec["scaled"] else None,
                           seg_align=m.seg_align)  # fmt: skip
    elif fam == "expand":
        from ditserve.kernels.lora_expand.op import launch_lora_expand

        y = E(t, sum(sizes), dtype=dt)
        mode = spec["mode"]
        launch_lora_expand(y, E(sl, t, r, dtype=torch.float32), b, *seg, m.seg_scale, m.slot_rank, sizes,
                           accumulate=mode.startswith("acc"), bias=E(sum(sizes), dtype=dt) if "bias" in mode else None,
                           config=cfg, seg_align=m.seg_align)  # fmt: skip
    elif fam == "sgmv":
        chunks = (m.sorted_token_ids, m.chunk_slot, m.chunk_start, m.chunk_len)
        if spec["op"] == "shrink":
            from ditserve.kernels.lora_shrink_sgmv.op import launch_lora_shrink_sgmv

            launch_lora_shrink_sgmv(x, a, *chunks, m.slot_rank, r, m.chunk_size, config=cfg)
        else:
            from ditserve.kernels.lora_expand_sgmv.op import launch_lora_expand_sgmv

            y = E(t, sum(sizes), dtype=dt)
            ids, slot, cstart, clen = chunks
            launch_lora_expand_sgmv(y, E(sl, t, r, dtype=torch.float32), b, ids, m.token_scale, slot, cstart, clen,
                                    m.slot_rank, sizes, m.chunk_size, config=cfg)  # fmt: skip
    elif fam == "gemm":
        from ditserve.kernels.lora_gemm.op import launch_lora_gemm

        w = E(sum(sizes), HIDDEN, dtype=dt)
        s_mode = spec["s_mode"]
        if s_mode == "scaled":
            s = E(sl, t, -(-r // 16) * 16, dtype=dt)
        else:
            s = E(sl, t, r, dtype=torch.float32)
        bias = E(sum(sizes), dtype=dt) if spec["bias"] else None
        launch_lora_gemm(x, w, bias, s, b, *seg, m.seg_scale, m.slot_rank, sizes, config=cfg,
                         s_scaled=s_mode == "scaled", seg_align=m.seg_align)  # fmt: skip
    elif fam == "linear":
        from ditserve.kernels.lora_linear.op import launch_lora_linear
        from ditserve.kernels.policy import KernelPolicy

        w = E(sum(sizes), HIDDEN, dtype=dt)
        bias = E(sum(sizes), dtype=dt) if spec["bias"] else None
        # the Triton path (the Gluon one-launch has cases of its own; its contract needs a Hopper GPU)
        launch_lora_linear(x, w, bias, a, b, *seg, m.seg_scale, m.slot_rank, r, sizes, m.seg_align, config=cfg,
                           policy=KernelPolicy(gluon=False))  # fmt: skip
    else:
        raise ValueError(fam)


def _run_gluon(spec: dict, cfg: dict) -> None:
    """The Gluon launchers on the batches tests/kernels/test_gluon_compile.py uses: 4 equal requests."""
    import torch

    E, dt, op, r = torch.empty, torch.bfloat16, spec["op"], spec["rank"]

    def batch(tokens, loras=4):
        token_seg = torch.arange(tokens, dtype=torch.int32) // (tokens // 4)
        return (token_seg, torch.arange(4, dtype=torch.int32) * (tokens // 4),
                torch.full((4,), tokens // 4, dtype=torch.int32), torch.arange(4, dtype=torch.int32),
                torch.ones(4), torch.full((loras,), r, dtype=torch.int32))  # fmt: skip

    sizes = [HIDDEN] * 3
    if op == "shrink":
        from ditserve.kernels.lora_shrink import gluon_op

        sl, scaled = spec["slices"], spec["scaled"]
        token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank = batch(1280)
        x, a = E(1280, HIDDEN, dtype=dt), E(sl, 4, r, HIDDEN, dtype=dt)
        s = E(sl, 1280, -(-r // 16) * 16 if scaled else r, dtype=dt if scaled else torch.float32)
        gluon_op.launch_gluon_lora_shrink(x, a, s, token_seg, seg_start, seg_len, seg_slot,
                                          seg_scale if scaled else None, slot_rank,
                                          {**gluon_op.GLUON_SHRINK_CONFIG, **cfg})  # fmt: skip
    elif op == "expand":
        from ditserve.kernels.lora_expand import gluon_op

        sizes = sizes if spec["slices"] == 3 else [*sizes, 4 * HIDDEN]
        token_seg, _, _, seg_slot, seg_scale, slot_rank = batch(1536)
        gluon_op.launch_gluon_lora_expand(E(1536, sum(sizes), dtype=dt), E(len(sizes), 1536, r),
                                          E(4, sum(sizes), r, dtype=dt), token_seg, seg_slot, seg_scale, slot_rank,
                                          sizes, {**gluon_op.GLUON_EXPAND_CONFIG, **cfg})  # fmt: skip
    elif op == "linear":
        from ditserve.kernels.lora_gemm import gluon_op

        token_seg, _, _, seg_slot, seg_scale, slot_rank = batch(1024)
        gluon_op.launch_gluon_lora_linear(E(1024, HIDDEN, dtype=dt), E(sum(sizes), HIDDEN, dtype=dt), None,
                                          E(3, 4, r, HIDDEN, dtype=dt), E(4, sum(sizes), r, dtype=dt), token_seg,
                                          seg_slot, seg_scale, slot_rank, r, sizes,
                                          {**gluon_op.GLUON_CONFIG, **cfg})  # fmt: skip
    else:
        from ditserve.kernels.lora_gemm import gluon_op

        token_seg, _, _, seg_slot, _, _ = batch(2304)
        gluon_op.launch_gluon_lora_gemm(E(2304, HIDDEN, dtype=dt), E(sum(sizes), HIDDEN, dtype=dt), None,
                                        E(3, 2304, r, dtype=dt), E(4, sum(sizes), r, dtype=dt), token_seg, seg_slot,
                                        sizes, {**gluon_op.GLUON_CONFIG, **cfg})  # fmt: skip


# ------------------------------------------------------------------------------------------------ comparison

_DEBUG_LINE = re.compile(r"^\s*(\.loc|\.file)\b|^\s*\$L__(tmp|func_begin|func_end|info_string|debug)\w*:")


def strip_debug(ptx: str, tree: str = "") -> str:
    """PTX without debug info: .loc/.file lines, debug-only labels, `.section .debug_*` blocks, paths."""
    out, depth = [], 0
    for line in ptx.splitlines():
        if depth:
            depth += line.count("{") - line.count("}")
            continue
        if re.match(r"^\s*\.section\s+\.debug", line):
            depth = line.count("{") - line.count("}")
            if depth <= 0:  # the block opens on a later line
                depth = 1 if "{" not in line else 0
            continue
        if _DEBUG_LINE.match(line) or not line.strip():
            continue
        if tree:
            line = line.replace(tree, "<tree>")
        out.append(line.rstrip())
    return "\n".join(out) + "\n"


_REG = re.compile(r"%(r|rd|rs|f|fd|p|h|hh|b|rb)\d+|\$L__BB\d+_\d+|__\w+_param_\d+")


def normalize(ptx: str) -> list[str]:
    """Lines with register numbers and branch labels erased: equal lists differ only in naming."""
    return [
        _REG.sub(lambda m: m.group(0).rstrip("0123456789_") or "x", line).strip() for line in ptx.splitlines()
    ]


def classify(a: str, b: str) -> str:
    na, nb = normalize(a), normalize(b)
    if na == nb:
        return "cosmetic: register numbers / labels only"  # (same lines up to naming)
    if Counter(na) == Counter(nb):
        return "reordered: the same lines in another order"

    def ops(lines: list[str]) -> Counter:
        return Counter(ln.split()[0] for ln in lines if ln and not ln.startswith(("//", ".", "$", "{", "}")))

    oa, ob = ops(na), ops(nb)
    delta = {k: ob[k] - oa[k] for k in set(oa) | set(ob) if oa[k] != ob[k]}
    top = ", ".join(f"{k} {v:+d}" for k, v in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:8])
    return f"real: {len(na)} → {len(nb)} lines; instruction counts {top or 'equal (operands differ)'}"


def sass(cubin: str | None) -> str | None:
    """cuobjdump's SASS of a kept cubin (no line info), or None where either is missing."""
    if not cubin or not os.path.isfile(cubin):
        return None
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.is_file() else "cuobjdump"
    try:
        out = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return "\n".join(
        ln for ln in out.splitlines() if ln.strip() and "Fatbin" not in ln and ".cubin" not in ln
    )


def sass_verdict(a: str | None, b: str | None) -> str:
    """Whether ptxas made the same code of two PTX texts: same SASS, the same instructions scheduled or
    allocated otherwise, or other instructions."""
    if a is None or b is None:
        return "SASS not compared"
    if a == b:
        return "SASS same"

    def opcodes(text: str) -> Counter:
        ops = Counter()
        for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text):
            ops[m.group(2)] += 1
        return ops

    oa, ob = opcodes(a), opcodes(b)
    if oa == ob:
        return f"SASS: same {sum(oa.values())} instructions, other schedule/registers"
    delta = {k: ob[k] - oa[k] for k in set(oa) | set(ob) if oa[k] != ob[k]}
    top = ", ".join(f"{k} {v:+d}" for k, v in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:8])
    return f"SASS differs: {sum(oa.values())} → {sum(ob.values())} instructions ({top})"


def _config_key(rec: dict) -> str:
    consts = ",".join(f"{k}={v}" for k, v in sorted(rec["constexprs"].items()))
    opts = ",".join(f"{k}={v}" for k, v in sorted(rec["options"].items()))
    return f"{consts} | {opts} | ({','.join(rec['signature'])})"


def _tree_version(tree: str) -> str:
    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return head.stdout.strip() or "?"


def _run_all(trees: dict[str, str], families: list[str], all_cases: dict, work: Path, cache: Path,
             triton_site: str | None, jobs: int) -> dict[str, dict[str, dict]]:  # fmt: skip
    """{label: {family: worker output}}; one process per (tree, family), at most `jobs` at once."""
    links = {}
    for label, tree in trees.items():
        d = work / f"link_{label}"
        d.mkdir(parents=True, exist_ok=True)
        link = d / "ditserve"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.realpath(tree))
        links[label] = d
    tri = "site" if triton_site else "venv"

    def one(label: str, family: str) -> tuple[str, str, dict]:
        case_file = work / f"cases_{family}.json"
        out_file = work / f"out_{label}_{family}.json"
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)
        key = hashlib.sha1(f"{os.path.realpath(trees[label])}|{tri}|{triton_site}".encode()).hexdigest()[:10]
        env["TRITON_CACHE_DIR"] = str(cache / key)
        env["PTX_SAME_CUBINS"] = str(work / "cubin")
        (work / "cubin").mkdir(exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_site, env.get("PYTHONPATH")) if p)
        cmd = [
            "nice",
            "-n",
            "5",
            sys.executable,
            str(HERE),
            "--worker",
            str(links[label]),
            trees[label],
            str(case_file),
            str(out_file),
        ]
        t0 = time.time()
        with open(work / f"log_{label}_{family}.txt", "w") as log:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode or not out_file.is_file():
            tail = (work / f"log_{label}_{family}.txt").read_text()[-2000:]
            return label, family, dict(crashed=f"exit {proc.returncode}: {tail}", results=[])
        print(f"  {label:4s} {family:7s} done in {time.time() - t0:.0f}s", flush=True)
        return label, family, json.loads(out_file.read_text())

    for family in families:
        (work / f"cases_{family}.json").write_text(json.dumps(all_cases[family]))
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    order = [(label, f) for f in families for label in trees]  # both trees of a family side by side
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for label, family, res in pool.map(lambda lf: one(*lf), order):
            out[label][family] = res
    return out


def _cubin_finder(cache: Path):
    """raw PTX → the cubin Triton's cache keeps next to it (for records written without a kept cubin)."""
    index: dict[str, str] = {}

    def find(ptx: str) -> str | None:
        if not index:
            for f in cache.glob("*/*/*.ptx"):
                index[hashlib.sha1(f.read_bytes()).hexdigest()] = str(f.with_suffix(".cubin"))
        return index.get(hashlib.sha1(ptx.encode()).hexdigest())

    return find


def compare(out: dict, trees: dict[str, str], families: list[str], diff_lines: int, cache: Path) -> int:
    base, head = out["base"], out["head"]
    status = 0
    per_kernel: dict[str, dict] = defaultdict(lambda: dict(configs=set(), same=set(), diff={}, errors=[]))
    notes: list[str] = []
    find = _cubin_finder(cache)
    for family in families:
        b, h = base.get(family, {}), head.get(family, {})
        for label, res in (("base", b), ("head", h)):
            if res.get("crashed"):
                notes.append(f"{family}: {label} worker crashed: {res['crashed']}")
                status = max(status, 2)
            if res.get("stray_modules"):
                notes.append(
                    f"{family}: {label} imported modules from outside its tree: {res['stray_modules']}"
                )
                status = max(status, 2)
        hres = {c["name"]: c for c in h.get("results", [])}
        for cb in b.get("results", []):
            ch = hres.get(cb["name"])
            if ch is None:
                continue
            if cb["error"] or ch["error"]:
                if cb["error"] != ch["error"]:
                    status = max(status, 2)
                    per_kernel[f"({family})"]["errors"].append(
                        f"{cb['name']}: base {cb['error'] or 'ok'} / head {ch['error'] or 'ok'}"
                    )
                else:
                    per_kernel[f"({family})"]["errors"].append(f"{cb['name']}: both fail: {cb['error']}")
                    continue
            if len(cb["records"]) != len(ch["records"]):
                status = max(status, 1)
                notes.append(
                    f"{cb['name']}: base compiled {len(cb['records'])} kernel(s), head {len(ch['records'])}"
                )
            for rb, rh in zip(cb["records"], ch["records"], strict=False):
                name = rb["kernel"] if rb["kernel"] == rh["kernel"] else f"{rb['kernel']} → {rh['kernel']}"
                k = _config_key(rb)
                entry = per_kernel[name]
                entry["configs"].add(k)
                pb = strip_debug(rb["ptx"], os.path.realpath(trees["base"]))
                ph = strip_debug(rh["ptx"], os.path.realpath(trees["head"]))
                if pb == ph and _config_key(rh) == k:
                    entry["same"].add(k)
                elif k not in entry["diff"]:
                    entry["diff"][k] = dict(case=cb["name"], base=pb, head=ph, head_key=_config_key(rh),
                                            cubins=(rb.get("cubin") or find(rb["ptx"]),
                                                    rh.get("cubin") or find(rh["ptx"])))  # fmt: skip
    print()
    print(f"{'kernel':44s} {'configs':>7s} {'same':>5s} {'differ':>6s}  result")
    for name in sorted(per_kernel):
        e = per_kernel[name]
        if not e["configs"]:
            continue
        nd = len(e["diff"])
        print(
            f"{name:44s} {len(e['configs']):7d} {len(e['same']):5d} {nd:6d}  {'DIFFERENT' if nd else 'same'}"
        )
        status = max(status, 1) if nd and status < 2 else status
    for name in sorted(per_kernel):
        e = per_kernel[name]
        for err in e["errors"]:
            print(f"  {name}: {err}")
    for note in notes:
        print("note:", note)
    # differences grouped by kernel and verdict: each group's cases, and the diff of its first one
    for name in sorted(per_kernel):
        groups: dict[tuple, list] = defaultdict(list)
        for k, d in per_kernel[name]["diff"].items():
            verdict = classify(d["base"], d["head"])
            d["sass"] = sass_verdict(*(sass(c) for c in d["cubins"]))
            same_sass = (
                d["sass"].split(":")[0] if "other schedule" not in d["sass"] else "SASS: same instructions"
            )
            groups[verdict.split(";")[0] if verdict.startswith("real") else verdict, same_sass].append((k, d))
        for (verdict, same_sass), items in groups.items():
            print(f"\n=== {name}: {len(items)} config(s): PTX {verdict}; {same_sass}")
            for k, d in items:
                print(f"    [{d['case']}] {k}")
                if d["sass"] != "SASS same":
                    print(f"        {d['sass']}")
                if d["head_key"] != k:
                    print(f"        head's config: {d['head_key']}")
            d = items[0][1]
            print(f"    {classify(d['base'], d['head'])}")
            diff = list(difflib.unified_diff(d["base"].splitlines(), d["head"].splitlines(), "base", "head", n=2,
                                             lineterm=""))  # fmt: skip
            for line in diff[:diff_lines]:
                print("    " + line)
            if len(diff) > diff_lines:
                print(f"    ... {len(diff) - diff_lines} more diff lines")
    return status


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(*sys.argv[2:6])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="checkout compared against (e.g. a git worktree)")
    p.add_argument("--head", required=True, help="checkout under test (e.g. /work/main)")
    p.add_argument("--only", default="", help="families, comma separated: " + ",".join(cases()))
    p.add_argument("--match", default="", help="only cases whose name matches this regex")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at once (default 2)")
    p.add_argument(
        "--triton-site", default=None, help="folder with another Triton, first on the workers' path"
    )
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "ptx_same_cache"))
    p.add_argument(
        "--work", default=None, help="where worker inputs, outputs and logs go (default: a temp dir)"
    )
    p.add_argument("--diff-lines", type=int, default=40)
    p.add_argument("--compare-only", action="store_true", help="compare the outputs already in --work")
    a = p.parse_args()
    all_cases = cases()
    families = [f for f in (a.only.split(",") if a.only else all_cases) if f]
    if a.match:
        all_cases = {f: [c for c in cs if re.search(a.match, c["name"])] for f, cs in all_cases.items()}
        families = [f for f in families if all_cases.get(f)]
    work = Path(a.work or tempfile.mkdtemp(prefix="ptx_same_"))
    work.mkdir(parents=True, exist_ok=True)
    trees = {"base": a.base, "head": a.head}
    for label, tree in trees.items():
        print(f"{label}: {tree} at {_tree_version(tree)}")
    n = sum(len(all_cases[f]) for f in families)
    print(f"{n} launches per tree in {', '.join(families)}; work folder {work}", flush=True)
    if a.compare_only:
        out = {label: {f: json.loads((work / f"out_{label}_{f}.json").read_text()) for f in families
                       if (work / f"out_{label}_{f}.json").is_file()} for label in trees}  # fmt: skip
    else:
        out = _run_all(trees, families, all_cases, work, Path(a.cache), a.triton_site, max(1, min(a.jobs, 2)))
    tri = {out[label][f].get("triton") for label in out for f in out[label]} - {None}
    print(f"Triton {', '.join(sorted(tri))}, target sm_90 (cuda 90)")
    return compare(out, trees, families, a.diff_lines, Path(a.cache))


if __name__ == "__main__":
    sys.exit(main())
