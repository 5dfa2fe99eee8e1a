"""A folder of a supported pipeline class that holds a variant the family does not run (here: Wan folders
whose two experts are half there) is refused with a message naming what was found, before anything starts
(not served wrong)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from ditserve.replica.models.registry import resolve_model


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
