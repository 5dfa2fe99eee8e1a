"""The one way a benchmark writes its results: `<out>/<theme>_<gpu>_<yyyymm>_<sha>.md` + `.json` (out:
benchmarks/results by default), each with the command line, the machine, the library versions, the commit and
the baseline measured in the same run; the .json holds the script's own results under "results".

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from a script in a theme folder
    from report import write_results
    write_results("lora_kernels", markdown, records, out=args.out, baseline="F.linear (cuBLAS), a torch clone")
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
_VERSIONED = ("torch", "triton", "diffusers", "transformers", "ray")


def commit() -> str:
    """The commit measured: GIT_COMMIT (machines whose copy has no git history), else git's short HEAD."""
    sha = os.environ.get("GIT_COMMIT", "")
    if not sha:
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            sha = ""
    return sha[:7] or "nogit"


def machine() -> tuple[str, str]:
    """(file-name tag, description) of the machine: the GPU ("h200", "NVIDIA H200 x1") or "cpu"."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            tag = re.sub(r"[^a-z0-9]+", "_", name.lower().removeprefix("nvidia ")).strip("_")
            count = torch.cuda.device_count()
            return (tag if count == 1 else f"{count}x{tag}"), f"{name} x{count}"
    except ImportError:
        pass
    return "cpu", "CPU only"


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for name in _VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def markdown_table(rows: list[dict]) -> str:
    """A markdown table of rows (dicts), columns in first-seen order."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    theme: str,
    markdown: str,
    data: Any,
    *,
    out: str | Path | None = None,
    baseline: str = "",
) -> tuple[Path, Path]:
    """Write (or overwrite, for partial results during a run) this run's results file pair; returns the paths."""
    tag, gpu = machine()
    sha = commit()
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{theme}_{tag}_{now:%Y%m}_{sha}"
    folder = Path(out) if out else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", *sys.argv])
    vers = versions()
    head = [
        f"# {theme} ({gpu})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {gpu}; "
        + ", ".join(f"{k} {v}" for k, v in vers.items())
        + f"; commit {sha}; {now:%Y-%m-%d}",
    ]
    if baseline:
        head.append(f"Baseline, measured in the same run: {baseline}")
    md_path, json_path = folder / f"{stem}.md", folder / f"{stem}.json"
    md_path.write_text("\n".join(head) + "\n\n" + markdown.rstrip() + "\n")
    meta = dict(
        theme=theme, gpu=gpu, month=f"{now:%Y%m}", date=f"{now:%Y-%m-%d}", commit=sha, command=command
    )
    payload = dict(meta, versions=vers, baseline=baseline, results=data)
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    print(f"results: {md_path}", flush=True)
    return md_path, json_path


def read_results(folder: str | Path, theme: str) -> Any:
    """The "results" of the newest results file of `theme` in folder (tests of the benchmarks' CPU modes)."""
    paths = sorted(Path(folder).glob(f"{theme}_*.json"), key=lambda p: p.stat().st_mtime)
    if not paths:
        raise FileNotFoundError(f"no {theme}_*.json in {folder}")
    return json.loads(paths[-1].read_text())["results"]


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind, by its name (torch.profiler's key): "attention" (cuDNN / flash / memory-efficient
    SDPA), "conv" (cuDNN convolutions: the VAE), "gemm" (cuBLAS / CUTLASS / nvjet), "triton fused"
    (inductor's elementwise and reduction kernels, and ours: ``_<op>_kernel``), "copy" (copies, casts and memsets) or "other" (eager
    elementwise). Attention and convolution names also carry GEMM words (``sm90``, ``wgmma``,
    ``implicit_gemm``), so they are matched first, after inductor's (``triton_*``, named after what they fuse,
    e.g. ``triton_poi_fused__scaled_dot_product_cudnn_attention_permute``: a layout copy before SDPA)."""
    low = name.lower()
    if low.startswith("triton"):  # inductor names its kernels after the ops fused in them, SDPA's too
        return "triton fused"
    if any(k in low for k in ("attention", "fmha", "flash", "sdpa")):
        return "attention"
    if any(k in low for k in ("fprop", "dgrad", "conv", "nchwtonhwc", "nhwctonchw")):
        return "conv"
    if any(k in low for k in ("gemm", "sm90", "cutlass", "nvjet", "matmul", "xmma")):
        return "gemm"
    if "triton" in low or (low.startswith("_") and low.endswith("_kernel")):  # ours: kernels/*/kernel.py
        return "triton fused"
    if any(k in low for k in ("copy", "memcpy", "memset", "fill")):
        return "copy"
    return "other"
