"""Model folders as users have them on disk. A folder of a supported pipeline class that holds a variant the
family does not run (here: Wan folders whose two experts are half there), or that lacks a component its
model_index.json lists, is refused with a message naming what was found, before anything starts (not served
wrong, nor a traceback from deep inside diffusers). Folders saved with ``variant="fp16"`` and sharded
weights load, also from the Hugging Face cache by repo id."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ditserve.replica.models.registry import resolve_model
from tests.helpers import png_pixels


@pytest.fixture
def wan_folder(tmp_path):
    folder = tmp_path / "wan"
    shutil.copytree(resolve_model("demo-wan").path, folder)
    return folder


def rewrite_index(folder, **changes) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **changes}))


def test_wan21_folder_is_served(wan_folder):
    spec = resolve_model(str(wan_folder))
    assert spec.family == "wan" and spec.first_frame == "none"
    rewrite_index(wan_folder, expand_timesteps=True)  # TI2V-5B's per-token timesteps: text or first frame
    assert resolve_model(str(wan_folder)).first_frame == "optional"


EXPERT = ["diffusers", "WanTransformer3DModel"]


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"transformer_2": EXPERT}, "transformer_2 and boundary_ratio come together"),
        ({"boundary_ratio": 0.9}, "transformer_2 and boundary_ratio come together"),
        ({"transformer_2": EXPERT, "boundary_ratio": 0.875}, "no transformer_2/config.json"),
    ],
)
def test_wan22_variants_are_refused(wan_folder, changes, needle):
    rewrite_index(wan_folder, **changes)
    with pytest.raises(ValueError, match=needle):
        resolve_model(str(wan_folder))
    if "boundary_ratio" in changes:
        return  # the CLI path is the same for every refusal: shown once
    # As a user meets it: the CLI exits 2 with the message, nothing generated.
    cmd = [sys.executable, "-m", "ditserve.cluster.cli", "generate", "a fox", "--model", str(wan_folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and needle in done.stderr and "--model" in done.stderr, done.stderr


# ---- folders as diffusers users have them ----------------------------------------------------------------
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache_entry(src: Path, hub_cache: Path, repo_id: str) -> Path:
    """``src`` laid out as the Hugging Face cache holds a download: files stored once by hash in ``blobs/``,
    ``snapshots/<commit>/`` of relative symlinks to them, ``refs/main`` naming the commit."""
    entry = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    for file in sorted(src.rglob("*")):
        if file.is_file():
            data = file.read_bytes()
            blob = entry / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / file.relative_to(src)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def flux_fp16_folder(tmp_path_factory):
    """demo-flux saved as ``save_pretrained(variant="fp16", max_shard_size=...)`` writes a big model:
    ``diffusion_pytorch_model.fp16-00001-of-000NN.safetensors`` beside an index, no plain weights."""
    import torch
    from diffusers import FluxPipeline

    folder = tmp_path_factory.mktemp("variants") / "flux-fp16"
    pipe = FluxPipeline.from_pretrained(resolve_model("demo-flux").path, dtype=torch.float32)
    pipe.save_pretrained(folder, variant="fp16", max_shard_size="200KB")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.fp16.json").is_file()
    assert not list(folder.glob("*/diffusion_pytorch_model.safetensors"))
    return folder


def _image(model: str) -> object:
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.engine import Engine
    from ditserve.replica.request import GenerationParams

    engine = Engine(EngineConfig(model=model)).start()
    try:
        params = GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=2, seed=3)
        return png_pixels(engine.submit(params).result(timeout=300).outputs[0])
    finally:
        engine.shutdown()


def test_fp16_variant_sharded_folder_loads_by_repo_id_from_the_hub_cache(
    flux_fp16_folder, tmp_path, monkeypatch
):
    """diffusers' from_pretrained loads such a folder only when told ``variant="fp16"`` (without it: "no file
    named diffusion_pytorch_model.bin", the traceback users saw); ditserve finds the variant in the file names.
    ``--model org/name`` reads the Hub cache as diffusers does offline, and the model is named by its repo id
    (not by the snapshot's commit) when its snapshot folder is given."""
    from huggingface_hub import constants

    snapshot = hub_cache_entry(flux_fp16_folder, tmp_path / "hub", "tiny-org/tiny-flux")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # rank processes read it when they start
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = resolve_model("tiny-org/tiny-flux")
    assert (spec.name, spec.path, spec.variant) == ("tiny-org/tiny-flux", snapshot, "fp16")
    assert resolve_model(str(snapshot)).name == "tiny-org/tiny-flux"
    entry = resolve_model(
        str(tmp_path / "hub" / "models--tiny-org--tiny-flux")
    )  # the entry, not its snapshot
    assert (entry.name, entry.path) == ("tiny-org/tiny-flux", snapshot)
    assert resolve_model(str(flux_fp16_folder)).variant == "fp16"
    assert (_image("tiny-org/tiny-flux") == _image("demo-flux")).all()  # the same weights, renamed


def test_a_repo_id_not_in_the_cache_is_refused_saying_where_it_looked(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(
        ValueError, match=r"'tiny-org/absent': .*not in the Hugging Face cache \(.*empty-hub\)"
    ):
        resolve_model("tiny-org/absent")


def test_a_single_file_checkpoint_is_refused_saying_how_to_convert_it(flux_fp16_folder):
    file = next((flux_fp16_folder / "transformer").glob("*.safetensors"))
    with pytest.raises(ValueError, match="is a single-file checkpoint; .*from_single_file"):
        resolve_model(str(file))


def test_a_component_folder_is_refused_naming_its_pipeline_folder(flux_fp16_folder):
    with pytest.raises(
        ValueError,
        match=f"is the vae/ component of a pipeline folder; give the pipeline folder, {flux_fp16_folder}$",
    ):
        resolve_model(str(flux_fp16_folder / "vae"))


def test_the_current_folder_is_named_by_its_own_name(flux_fp16_folder, monkeypatch):
    monkeypatch.chdir(flux_fp16_folder)
    assert resolve_model(".").name == flux_fp16_folder.name  # was "": /v1/models listed a model without an id


@pytest.fixture
def flux_folder(tmp_path):
    folder = tmp_path / "flux"
    shutil.copytree(resolve_model("demo-flux").path, folder)
    return folder


def _remove_vae(folder: Path) -> str:
    shutil.rmtree(folder / "vae")
    return "lacks vae/ (AutoencoderKL), which its model_index.json lists"


def _remove_encoders(folder: Path) -> str:
    shutil.rmtree(folder / "text_encoder")
    shutil.rmtree(folder / "tokenizer_2")
    return "lacks text_encoder/ (CLIPTextModel), tokenizer_2/ (T5Tokenizer), which"


def _remove_weights(folder: Path) -> str:
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    return "transformer/ holds no weights"


def _remove_config(folder: Path) -> str:
    (folder / "text_encoder_2" / "config.json").unlink()
    return "text_encoder_2/ has no config.json"


def _truncated_index(folder: Path) -> str:
    (folder / "model_index.json").write_text('{"_class_name": "FluxPipeline",')
    return f"{folder}/model_index.json is not valid JSON (Expecting"


def _truncated_config(folder: Path) -> str:
    (folder / "transformer" / "config.json").write_text("version https://git-lfs.github.com/spec/v1\n")
    return "transformer/config.json is not valid JSON"  # a Git LFS pointer where the file should be


def _lfs_pointer(folder: Path) -> str:
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize 20971520\n".format("0" * 64)
    (folder / "vae" / "diffusion_pytorch_model.safetensors").write_text(pointer)
    return "vae/diffusion_pytorch_model.safetensors are Git LFS pointers, not weights"


def _two_variants(folder: Path) -> str:
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    shutil.copy(weights, weights.with_suffix(".bf16.safetensors"))
    weights.rename(weights.with_suffix(".fp16.safetensors"))
    return "holds only variant weights (vae/: ['bf16', 'fp16'])"


@pytest.mark.parametrize(
    "damage",
    [
        _remove_vae,
        _remove_encoders,
        _remove_weights,
        _remove_config,
        _truncated_index,
        _truncated_config,
        _lfs_pointer,
        _two_variants,
    ],
)
def test_a_folder_lacking_what_its_index_lists_is_refused_naming_it_and_the_path(flux_folder, damage):
    needle = damage(flux_folder)
    with pytest.raises(ValueError, match="--model") as caught:
        resolve_model(str(flux_folder))
    assert needle in str(caught.value) and str(flux_folder) in str(caught.value)
    if damage is not _remove_vae:
        return  # the CLI path is the same for every refusal: shown once
    cmd = [sys.executable, "-m", "ditserve.cluster.cli", "generate", "a fox", "--model", str(flux_folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_weights_update_takes_a_folder_saved_with_a_variant(flux_fp16_folder):
    """POST /v1/admin/weights with such a folder was refused: "could not load weights from PATH: Error no file
    named diffusion_pytorch_model.bin found in directory PATH/transformer"."""
    import torch

    from ditserve.replica.config import EngineConfig
    from ditserve.replica.rank_control import ServingRankWorker

    worker = ServingRankWorker(EngineConfig(model="demo-flux"))
    before = worker.pipe.transformer.state_dict()
    assert worker.stage_weights(str(flux_fp16_folder), "fp16") == {"rank": 0, "tag": "fp16"}
    worker.commit_weights("fp16")
    after = worker.pipe.transformer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
