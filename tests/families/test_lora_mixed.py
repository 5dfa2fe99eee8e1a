"""Different adapters per request in one forward, for every family that takes adapters: two adapters on every
linear of the transformer (the time, text and modulation embedders and the heads too), stepped together on
four requests (one adapter, the other, none, both at their own scales; guided and unguided rows), give each
request the image or video its diffusers pipeline draws after ``load_lora_weights`` + ``set_adapters``."""

from __future__ import annotations

import pytest
import torch

from ditserve.kernels import _dispatch as dispatch
from ditserve.replica.config import EngineConfig
from ditserve.replica.rank_control import ServingRankWorker
from ditserve.replica.request import GenerationParams, LoRARef
from tests.families.harness import load_pipeline, picture, pipeline_output, single_thread  # noqa: F401 (single_thread: a fixture)
from tests.families.lora import save_random_lora
from tests.helpers import psnr

pytestmark = pytest.mark.usefixtures("single_thread")


def family_setup(family: str, path):
    """(pipeline class, folder, request fields, guidance fields, engine config, pipeline call kwargs, video)"""
    import diffusers

    size = {"width": 64, "height": 64, "num_inference_steps": 1}
    guided = {"guidance_scale": 4.0, "negative_prompt": "blurry"}
    if family == "sd3":
        from tests.families.sd3 import build_folder

        folder = build_folder(path)
        return diffusers.StableDiffusion3Pipeline, folder, size | {"width": 80, "height": 48}, guided, {"max_sequence_length": 16}, {"max_sequence_length": 16}, False  # fmt: skip
    if family == "zimage":
        from tests.families.zimage import build_folder

        folder = build_folder(path)
        return diffusers.ZImagePipeline, folder, size | {"width": 80, "height": 48}, guided, {"max_sequence_length": 64}, {"max_sequence_length": 64}, False  # fmt: skip
    if family == "qwenimage":
        from tests.families.qwenimage import build_folder

        folder = build_folder(path)
        # two steps: the pipeline's one-step schedule ends on a NaN timestep
        return diffusers.QwenImagePipeline, folder, size | {"num_inference_steps": 2}, {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}, {}, {}, False  # fmt: skip
    if family in ("flux2", "klein"):
        from tests.families.flux2 import MAX_TEXT_TOKENS, build_folder

        folder = build_folder(path, klein=family == "klein")
        cls = diffusers.Flux2KleinPipeline if family == "klein" else diffusers.Flux2Pipeline
        return cls, folder, size, {"guidance_scale": 4.0}, {}, {"max_sequence_length": MAX_TEXT_TOKENS}, False
    if family == "kontext":
        from tests.families.flux_kontext import build_folder

        folder = build_folder(path)
        call = {"max_area": 64 * 64, "max_sequence_length": 32}
        guided = {"guidance_scale": 3.5, "true_cfg_scale": 2.0, "negative_prompt": "blurry"}
        return diffusers.FluxKontextPipeline, folder, size | {"images": (picture(64, 64, 0),)}, guided, {}, call, False  # fmt: skip
    if family in ("wan22", "ti2v"):
        from tests.families.wan22 import TEXT_LENGTH, build_folder

        folder = build_folder(path, variant="a14b" if family == "wan22" else "ti2v")
        # A14B: two steps, the second on the low-noise expert (the adapters hold the first's weights only)
        fields = size | {"num_frames": 5, "height": 48 if family == "wan22" else 64}
        fields["num_inference_steps"] = 2 if family == "wan22" else 1
        text = {"max_sequence_length": TEXT_LENGTH}
        return diffusers.WanPipeline, folder, fields, guided, text, text | {"num_frames": 5}, True
    from tests.families.wan_i2v import build_folder, reference_png

    folder = build_folder(path, variant="wan21")
    fields = size | {"num_frames": 5, "height": 48, "images": (reference_png(),)}
    return diffusers.WanImageToVideoPipeline, folder, fields, guided, {}, {"num_frames": 5}, True


FAMILIES = ["sd3", "zimage", "qwenimage", "flux2", "klein", "kontext", "wan22", "ti2v", "wan_i2v"]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_adapters_on_every_linear_per_request_in_one_batch(family, tmp_path, monkeypatch):
    # the LoRA path a CPU user runs (torch), not the Triton interpreter this process turns on for its kernel
    # tests (tests.helpers.user_env)
    monkeypatch.setattr(dispatch, "_INTERPRET_AT_IMPORT", False)
    cls, folder, fields, guided, config, call, video = family_setup(family, tmp_path / "model")
    pipe = load_pipeline(cls, folder)
    linears = [n for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    a = save_random_lora(cls, pipe.transformer, linears, tmp_path / "a", rank=2, seed=1)
    b = save_random_lora(cls, pipe.transformer, linears, tmp_path / "b", rank=3, seed=2)
    base = GenerationParams(prompt="a red fox", **fields)
    requests = {
        "a": base.model_copy(update={**guided, "seed": 3, "lora": (LoRARef(name="a", scale=0.4),)}),
        "b": base.model_copy(update={"seed": 4, "lora": (LoRARef(name="b", scale=0.7),)}),
        "none": base.model_copy(update={**guided, "seed": 5}),
        "both": base.model_copy(
            update={"seed": 6, "lora": (LoRARef(name="a", scale=0.3), LoRARef(name="b", scale=0.5))}
        ),  # fmt: skip
    }
    worker = ServingRankWorker(EngineConfig(model=str(folder), **config))
    worker.lora_load("a", str(a))
    worker.lora_load("b", str(b))
    for req_id, p in requests.items():
        worker.add(req_id, p)
    while not all(worker.states[r].done for r in requests):
        buckets: dict = {}
        for r in requests:
            if not worker.states[r].done:
                buckets.setdefault(worker.states[r].bucket, []).append(r)
        for ids in buckets.values():
            worker.step(ids)
    got = {r: worker.finish(r)["pixels"][0] for r in requests}

    pipe.load_lora_weights(str(a), adapter_name="a")
    pipe.load_lora_weights(str(b), adapter_name="b")
    for req_id, p in requests.items():
        if p.lora:
            pipe.enable_lora()
            pipe.set_adapters([r.name for r in p.lora], [r.scale for r in p.lora])
        else:
            pipe.disable_lora()
        kwargs = {k: getattr(p, k) for k in ("guidance_scale", "true_cfg_scale", "negative_prompt") if k in p.model_fields_set}  # fmt: skip
        want = pipeline_output(pipe, p, **call, **kwargs)
        assert got[req_id].shape == want.shape, req_id
        assert psnr(got[req_id], want) >= 40, (req_id, psnr(got[req_id], want))
