"""`return_latents` on the in-process engine (what `ditserve generate` and Python users run): the final
packed latents come back next to the image, the same for the same seed."""

import numpy as np

from ditserve.replica.config import EngineConfig
from ditserve.replica.engine import Engine
from ditserve.replica.request import GenerationParams


def test_in_process_engine_returns_final_latents():
    engine = Engine(EngineConfig(model="demo-flux")).start()
    try:

        def run(seed):
            p = GenerationParams(prompt="a fox", width=64, height=64, num_inference_steps=2, seed=seed,
                                 return_latents=True)  # fmt: skip
            return engine.generate(p, timeout=60)

        a, b, c = run(1), run(1), run(2)
    finally:
        engine.shutdown()
    # 64×64 pixels → 4×4 packed latent tokens of 16 channels (2×2 patches of the 4-channel demo VAE)
    assert a.latents.shape == (1, 16, 16) and np.isfinite(a.latents).all()
    assert np.array_equal(a.latents, b.latents) and not np.array_equal(a.latents, c.latents)
    assert a.outputs and a.media_type == "image/png"
