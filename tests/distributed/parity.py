"""Parity cases: a tiny Flux / Wan model, sharded by a layout, must give the single-rank output.

Runs inside ranks started by `run_distributed`. Every rank builds the same model and inputs from fixed
seeds, computes the unsharded reference itself (tiny models, cheap), then runs each layout and returns
the max abs error per (model, layout, input shape) to the parent test.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel

from ditserve.replica.parallel import (
    ColumnParallelLinear,
    ParallelDims,
    ParallelMesh,
    RowParallelLinear,
    build_mesh,
    cfg_all_gather,
    parallelize_flux,
    parallelize_wan,
)
from ditserve.replica.parallel.dims import AXES

NUM_HEADS = 8
BATCH = 2  # two requests with different timesteps in one forward


@dataclass(frozen=True)
class Case:
    model: str  # "flux" | "wan"
    dims: ParallelDims
    shape: tuple[int, ...]  # flux: (h, w) latent tokens; wan: (frames, height, width) latent pixels

    @property
    def name(self) -> str:
        return f"{self.model}-{self.dims.describe()}-{'x'.join(map(str, self.shape))}"


def build_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=NUM_HEADS,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=[4, 6, 6],
    ).eval()


def build_wan(**extra: Any) -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        **extra,
        patch_size=(1, 2, 2),
        num_attention_heads=NUM_HEADS,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()


def build_wan_i2v() -> WanTransformer3DModel:
    """Wan 2.1 I2V layout: image-embedding context and added K/V projections in cross-attention."""
    return build_wan(image_dim=8, added_kv_proj_dim=96)


def flux_inputs(shape: tuple[int, ...], branch: int) -> dict[str, Any]:
    h, w = shape
    g = torch.Generator().manual_seed(100 + 7 * branch + h * 13 + w)
    num_text = 7
    ids = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
    img_ids = torch.cat([torch.zeros(h * w, 1), ids.float()], dim=1)
    return {
        "hidden_states": torch.randn(BATCH, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, num_text, 32, generator=g),
        "pooled_projections": torch.randn(BATCH, 32, generator=g),
        "timestep": torch.tensor([0.9, 0.3]),
        "guidance": torch.tensor([3.5, 3.5]),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(num_text, 3),
        "return_dict": False,
    }


def wan_inputs(shape: tuple[int, ...], branch: int) -> dict[str, Any]:
    f, h, w = shape
    g = torch.Generator().manual_seed(200 + 7 * branch + f * 31 + h * 13 + w)
    return {
        "hidden_states": torch.randn(BATCH, 4, f, h, w, generator=g),
        "timestep": torch.tensor([900, 300]),
        "encoder_hidden_states": torch.randn(BATCH, 9, 16, generator=g),
        "return_dict": False,
    }


def wan_per_token_timestep_inputs(shape: tuple[int, ...], branch: int) -> dict[str, Any]:
    """Wan 2.2 TI2V: one timestep per latent token, (B, tokens)."""
    inputs = wan_inputs(shape, branch)
    f, h, w = shape
    g = torch.Generator().manual_seed(300 + branch)
    inputs["timestep"] = torch.randint(0, 1000, (BATCH, f * (h // 2) * (w // 2)), generator=g)
    return inputs


def wan_i2v_inputs(shape: tuple[int, ...], branch: int) -> dict[str, Any]:
    """Wan's I2V processor splits context at `len - 512`, so the text context is 512 tokens long."""
    inputs = wan_inputs(shape, branch)
    g = torch.Generator().manual_seed(400 + branch)
    inputs["encoder_hidden_states"] = torch.randn(BATCH, 512, 16, generator=g)
    inputs["encoder_hidden_states_image"] = torch.randn(BATCH, 5, 8, generator=g)
    return inputs


BUILDERS = {
    "flux": (build_flux, flux_inputs, parallelize_flux),
    "wan": (build_wan, wan_inputs, parallelize_wan),
    "wan_tt": (build_wan, wan_per_token_timestep_inputs, parallelize_wan),
    "wan_i2v": (build_wan_i2v, wan_i2v_inputs, parallelize_wan),
}


def check_mesh(mesh: ParallelMesh, rank: int) -> None:
    """The DeviceMesh's groups are the ones ParallelDims documents, and degree-1 axes have none."""
    for axis in (*AXES, "sp"):
        sub = mesh.get_optional_mesh(axis)
        if mesh.dims.groups(axis)[0].__len__() == 1:
            assert sub is None, (axis, mesh.dims)
            continue
        assert sub is not None, (axis, mesh.dims)
        ranks = sub.mesh.flatten().tolist()
        assert rank in ranks and sorted(ranks) in mesh.dims.groups(axis), (axis, ranks, mesh.dims)
        assert mesh.local_rank(axis) == ranks.index(rank), (axis, ranks)


def check_tp_records(original: torch.nn.Module, sharded: torch.nn.Module, mesh: ParallelMesh) -> int:
    """Each TP linear's record (mode, rank, size, slices) says exactly which part of the weight it holds.

    This is the contract a LoRA-aware linear relies on to slice B (column) or A (row) the same way.
    """
    checked = 0
    for name, module in sharded.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        full = original.get_submodule(name).weight
        dim = 0 if module.tp_mode == "column" else 1
        assert (module.tp_rank, module.tp_size) == (mesh.tp_rank, mesh.tp_size), name
        expected = torch.cat([full.narrow(dim, a, b - a) for a, b in module.tp_slices], dim=dim)
        assert torch.equal(module.weight, expected), name
        checked += 1
    assert checked > 0 or mesh.tp_size == 1
    if mesh.tp_size > 1 and hasattr(sharded, "single_transformer_blocks"):
        proj_out = sharded.single_transformer_blocks[0].proj_out
        assert proj_out.tp_mode == "row" and len(proj_out.tp_slices) == 2  # cat(attention, mlp)
    return checked


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[tuple[str, float, float, float]]:
    """Run every case (all with dims.world_size == world_size).

    Returns (name, max abs error, max abs reference value, seconds) per case; the reference magnitude
    shows the comparison is not between two zero tensors.
    """
    models: dict[Any, torch.nn.Module] = {}
    refs: dict[tuple[str, tuple[int, ...], int], torch.Tensor] = {}
    results = []
    for case in cases:
        assert case.dims.world_size == world_size, case
        start = time.perf_counter()
        build, make_inputs, parallelize = BUILDERS[case.model]
        if build not in models:
            models[build] = build()
        base = models[build]
        with torch.no_grad():
            for branch in range(case.dims.cfg):
                key = (case.model, case.shape, branch)
                if key not in refs:
                    refs[key] = base(**make_inputs(case.shape, branch))[0]
            mesh = build_mesh(case.dims, "cpu", timeout=timedelta(seconds=60))
            check_mesh(mesh, rank)
            model = parallelize(copy.deepcopy(base), mesh=mesh)
            check_tp_records(base, model, mesh)
            local = model(**make_inputs(case.shape, mesh.cfg_rank))[0]
            stacked = cfg_all_gather(local, mesh)
            expected = torch.stack([refs[(case.model, case.shape, b)] for b in range(case.dims.cfg)])
        mesh.destroy()  # gloo groups keep threads; hundreds of layouts would pile them up
        assert stacked.shape == expected.shape, (case.name, stacked.shape, expected.shape)
        error = (stacked - expected).abs().max().item()
        results.append((case.name, error, expected.abs().max().item(), time.perf_counter() - start))
    return results
