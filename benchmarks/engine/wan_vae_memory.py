"""Peak host memory of the Wan runner's VAE decode against video length and size, tiled or not (CPU).

    python benchmarks/engine/wan_vae_memory.py                     # tiny random Wan 2.1 VAE, 160x96
    python benchmarks/engine/wan_vae_memory.py --size 320x192 --frames 33 129

Each point runs ``WanRunner.decode`` in a fresh process and reports ``ru_maxrss`` after the decode minus
before it (MiB), beside the size of the decoded frames themselves. AutoencoderKLWan decodes one latent
frame at a time with a causal cache, so the activations do not grow with the length; ``--tile 64`` cuts
each frame into 64-px tiles (diffusers' ``enable_tiling``; the runner turns it on above
``TILED_DECODE_PIXELS``, where the default 256-px tiles apply).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def point(frames: int, width: int, height: int, tile: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from ditserve.replica.pipelines import wan
    from ditserve.replica.pipelines.base import RequestState
    from ditserve.replica.request import GenerationParams
    from tests.families.wan22 import build_tiny

    pipe = build_tiny("a14b")
    runner = wan.WanRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=16)
    if tile:
        wan.TILED_DECODE_PIXELS = 0
        stride = tile * 3 // 4
        pipe.vae.enable_tiling(tile, tile, stride, stride)  # the runner's enable_tiling() keeps these
    else:
        wan.TILED_DECODE_PIXELS = 1 << 62
    params = GenerationParams(prompt="x", width=width, height=height, num_frames=frames)
    latents = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    state = RequestState("r", params, latents, None, torch.zeros(1), {}, None, 1.0, (), extra={})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    video = runner.decode(state)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "frames": frames,
        "size": f"{width}x{height}",
        "tile": tile,
        "peak_mib": round((after - before) / 1024, 1),
        "frames_mib": round(video.nbytes / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="160x96")
    parser.add_argument("--frames", type=int, nargs="+", default=[5, 17, 33, 65, 129])
    parser.add_argument("--tile", type=int, nargs="+", default=[0, 64], help="0: untiled")
    parser.add_argument("--point", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(point(*args.point)))
        return
    width, height = map(int, args.size.split("x"))
    for tile in args.tile:
        for frames in args.frames:
            cmd = [sys.executable, __file__, "--point", str(frames), str(width), str(height), str(tile)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            print(done.stdout.strip() or done.stderr[-800:], flush=True)


if __name__ == "__main__":
    main()
