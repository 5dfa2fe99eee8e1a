"""The tiny CPU modes of the Wan, LoRA and FLUX-step benchmarks run end to end and agree with stock diffusers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def results(folder: Path, theme: str):
    """What a benchmark wrote through benchmarks/report.py: (its results, its markdown)."""
    [path] = folder.glob(f"{theme}_*.json")
    payload = json.loads(path.read_text())
    assert (
        payload["theme"] == theme
        and payload["command"].startswith("python ")
        and payload["versions"]["torch"]
    )
    return payload["results"], path.with_suffix(".md").read_text()


def run_benchmark(script: str, *args: str) -> None:
    # The benchmark's own CPU path (the LoRA kernels' torch fallback), not the Triton interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--device", "cpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_wan_vs_diffusers_tiny(tmp_path):
    run_benchmark("engine/wan_vs_diffusers.py", "--no-compile", "--repeats", "1", "--out", str(tmp_path))
    result, markdown = results(tmp_path, "wan_vs_diffusers")
    assert result["meta"]["skipped"] == []
    rows = {(r["scheduler"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == {
        ("unipc", "diffusers eager"),
        ("unipc", "ditserve eager"),
        ("euler", "diffusers eager"),
        ("euler", "ditserve eager"),
        ("unipc", "ditserve eager + fp8"),
    }
    assert rows[("unipc", "ditserve eager")]["forwards"] == 2 * 2  # 2 steps × cond/uncond
    # Same scheduler on both sides: the runner makes diffusers' video, with Wan2.1's UniPC and with Euler.
    assert rows[("unipc", "ditserve eager")]["psnr_eager"] >= 40
    assert rows[("euler", "ditserve eager")]["psnr_eager"] >= 35
    assert 25 <= rows[("unipc", "ditserve eager + fp8")]["psnr_eager"] < float("inf")  # FP8: close, not equal
    assert "ditserve eager" in markdown


def test_lora_engine_tiny_with_peft(tmp_path):
    pytest.importorskip("peft")
    run_benchmark(
        "engine/lora_engine.py",
        "--size",
        "32",
        "--steps",
        "2",
        "--requests",
        "2",
        "--rank",
        "4",
        "--out",
        str(tmp_path),
    )
    rows, _ = results(tmp_path, "lora_engine")
    assert not [r for r in rows if r["impl"] == "skipped"], rows
    by_impl = {r["impl"]: r for r in rows}
    engine = by_impl["ditserve engine"]
    # the engine's policies timed in one run: the default and the shrink kernel launched first
    assert engine["ratio"] > 0 and engine["ratio_two_launches"] > 0
    assert set(by_impl) == {"diffusers", "diffusers + PEFT", "ditserve engine"}
    assert by_impl["diffusers + PEFT"]["requests"] == 2
    # The engine's batched adapters give each request the image diffusers + PEFT gives it alone.
    assert by_impl["ditserve engine"]["psnr_vs_peft_min"] >= 35


def test_flux_step_variants_tiny_with_fused_epilogues(tmp_path):
    """The variant that measures --fused-epilogues applies to the model and keeps its output."""
    run_benchmark("engine/flux_step_variants.py", "--variants", "eager,compiled+epilogues", "--iters", "1",
                  "--out", str(tmp_path))  # fmt: skip
    ms, text = results(tmp_path, "flux_step_variants")
    assert set(ms) == {"eager", "compiled+epilogues"} and all(ms[v].get("64", 0) > 0 for v in ms), ms
    assert int(text.split("fused epilogues in ")[1].split()[0]) > 0, text
    row = next(
        line for line in text.splitlines() if line.startswith("compiled+epilogues") and "ms/step" in line
    )
    rel = float(row.split("max|Δ| vs eager")[1].split()[0])
    assert rel < 2e-2, text


def test_engine_vs_diffusers_tiny_with_the_engine_switches(tmp_path):
    run_benchmark("engine/engine_vs_diffusers.py", "--sizes", "32", "--steps", "2", "--repeats", "1", "--no-compile",
                  "--extras", "epilogues,fp8,engine", "--out", str(tmp_path))  # fmt: skip
    result, _ = results(tmp_path, "engine_vs_diffusers")
    assert result["meta"]["skipped"] == []
    rows = {r["impl"]: r for r in result["rows"]}
    engine = "ditserve Engine, --fused-epilogues --quantization fp8"
    assert set(rows) == {"diffusers eager", "ditserve eager", "ditserve eager + epilogues",
                         "ditserve eager + epilogues + fp8", engine}  # fmt: skip
    # the whole Engine with the same flags draws the runner's image, its forwards timed
    assert rows[engine]["psnr_eager"] == rows["ditserve eager + epilogues + fp8"]["psnr_eager"]
    assert rows[engine]["forwards"] == 2 and rows[engine]["step_ms"] > 0
    assert rows["ditserve eager"]["psnr_eager"] == float("inf")  # the runner draws diffusers' image
    assert rows["ditserve eager + epilogues"]["psnr_eager"] >= 40
    assert 25 <= rows["ditserve eager + epilogues + fp8"]["psnr_eager"] < float("inf")


def load_benchmark(script: str):
    """A benchmark script as a module (its functions, without running main)."""
    import importlib.util

    name = Path(script).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_benchmark_leaves_out_a_variant_that_cannot_run():
    """The interleaved timing of `lora_kernels.py` drops a variant whose first call raises (a config that does
    not fit shared memory, say) and reports it; the others, and the baseline's failures, are not hidden."""
    bench = load_benchmark("kernels/lora_kernels.py")
    calls = []

    def too_big():
        raise RuntimeError("out of resource: shared memory, Required: 237592\nmore")

    ok, failed = bench.working(
        {"cuBLAS": lambda: calls.append("base"), "nb4": too_big, "e1": lambda: calls.append("e1")}
    )
    assert list(ok) == ["cuBLAS", "e1"] and calls == ["base", "e1"]
    assert failed == ["nb4: fail (RuntimeError: out of resource: shared memory, Required: 237592)"]
    with pytest.raises(RuntimeError):
        bench.working({"cuBLAS": too_big, "e1": lambda: None})


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1", "attention"),
        ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_cat_permute_view_5", "triton fused"),
        ("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize256x32x32", "conv"),
        ("nvjet_sm90_tst_192x208_64x4_2x1_v_bz_coopB_gelubias_TNT", "gemm"),
        ("Memcpy DtoH (Device -> Pageable)", "copy"),
    ],
)
def test_profile_kinds_of_the_kernels_an_h100_step_runs(kernel, kind):
    """``--profile`` splits a step into GEMMs and attention that every row shares and the rest: cuDNN's flash
    kernel and the VAE's convolutions carry GEMM words in their names, and inductor names a kernel after the
    SDPA it prepares; each is counted as what it is (names as torch.profiler gave them on an H100)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import kernel_kind

    assert kernel_kind(kernel) == kind
