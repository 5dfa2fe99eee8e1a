"""--encoder-placement: with ``first`` only the replica's first rank loads the text encoders and sends each
request's embeddings; the others never hold them, and the images are those of ``all`` (every rank
encoding for itself) and of one rank."""

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.request import GenerationParams
from tests.helpers import png_pixels, psnr

REQUEST = GenerationParams(
    prompt="a red fox",
    negative_prompt="blue",
    true_cfg_scale=2.0,
    width=64,
    height=64,
    num_inference_steps=2,
    seed=7,
)


def run(placement: str, ulysses_degree: int = 2):
    config = EngineConfig(
        model="demo-flux", encoder_placement=placement, parallel=ParallelFlags(ulysses_degree=ulysses_degree)
    )
    engine = Engine(config).start()
    try:
        memory = engine.run_control(lambda: engine.call_ranks("memory")).result(timeout=120)
        image = png_pixels(engine.submit(REQUEST).result(timeout=300).outputs[0])
        return memory, image
    finally:
        engine.shutdown()


def test_first_rank_holds_the_only_encoders_and_images_match():
    first, image_first = run("first")
    every, image_every = run("all")
    assert [m["rank"] for m in first] == [0, 1]
    assert first[0]["encoder_bytes"] > 0 and first[1]["encoder_bytes"] == 0
    assert all(m["encoder_bytes"] == first[0]["encoder_bytes"] for m in every)
    assert first[1]["transformer_bytes"] == first[0]["transformer_bytes"] > 0
    assert (image_first == image_every).all()
    _, image_one = run("first", ulysses_degree=1)
    assert psnr(image_first, image_one) >= 40
