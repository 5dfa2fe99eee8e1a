"""--fused-epilogues: FLUX blocks with the GELU in the up-projection's GEMM and proj_out without the
concat give the stock blocks' numbers; LoRA-carrying or tensor-parallel linears keep the stock path."""

import pytest
import torch
import torch.nn as nn
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.models.flux_fused import fuse_flux_epilogues, linear_gelu_tanh, linear_of_concat


def _inputs(model, device, dtype, n_img=64, n_txt=16):
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    ids = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij"), -1).reshape(-1, 2)
    img_ids = torch.cat([torch.zeros(n_img, 1), ids.float()], 1)
    return dict(
        hidden_states=torch.randn(2, n_img, cfg.in_channels, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(2, n_txt, cfg.joint_attention_dim, generator=g).to(device, dtype),
        pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        timestep=torch.tensor([0.3, 0.9], device=device, dtype=dtype),
        img_ids=img_ids.to(device),
        txt_ids=torch.zeros(n_txt, 3, device=device),
        guidance=torch.tensor([3.5, 3.5], device=device) if cfg.guidance_embeds else None,
        return_dict=False,
    )


def _demo_transformer(device="cpu", dtype=torch.float32):
    folder = ensure_demo_model("demo-flux")
    return FluxTransformer2DModel.from_pretrained(folder / "transformer", torch_dtype=dtype).to(device).eval()


@pytest.mark.parametrize("bias", [True, False])
def test_linear_of_concat_equals_linear_of_cat(bias):
    torch.manual_seed(0)
    lin = nn.Linear(24 + 40, 16, bias=bias)
    a, b = torch.randn(3, 5, 24), torch.randn(3, 5, 40)
    torch.testing.assert_close(linear_of_concat(lin, a, b), lin(torch.cat([a, b], -1)), atol=1e-5, rtol=1e-5)


def test_overridden_linears_keep_their_forward():
    """A LoRA layer replaces forward on the instance: the fused helpers must call it, not the raw weight."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 6)
    stock = lin.forward
    lin.forward = lambda x: stock(x) + 1.0  # what an installed adapter looks like from outside
    x = torch.randn(4, 8)
    torch.testing.assert_close(
        linear_gelu_tanh(x, lin), nn.functional.gelu(stock(x) + 1.0, approximate="tanh")
    )
    torch.testing.assert_close(linear_of_concat(lin, x[:, :3], x[:, 3:]), stock(x) + 1.0)


def test_patched_demo_flux_gives_the_stock_output(monkeypatch):
    """Every single block (its forward and its norm), and each double block's two feed-forward GELUs and two
    norms, patched; the adaLN norms run the one-pass kernel (Triton's interpreter here), once per norm and
    forward; the output is the stock one."""
    import ditserve.kernels.adaln.op as adaln_op

    launches = []
    real = adaln_op.launch_adaln
    monkeypatch.setattr(
        adaln_op, "launch_adaln", lambda x, *a, **k: launches.append(x.shape) or real(x, *a, **k)
    )
    model = _demo_transformer()
    feed = _inputs(model, "cpu", torch.float32)
    with torch.no_grad():
        want = model(**feed)[0]
        singles = sum(isinstance(m, FluxSingleTransformerBlock) for m in model.modules())
        doubles = len(model.transformer_blocks)
        changed = fuse_flux_epilogues(model)
        assert not launches
        got = model(**feed)[0]
    assert singles > 0 and changed == 2 * singles + 4 * doubles
    assert len(launches) == singles + 2 * doubles
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_bf16_gpu_patched_matches_stock(compile):
    model = _demo_transformer("cuda", torch.bfloat16)
    feed = _inputs(model, "cuda", torch.bfloat16)
    with torch.no_grad():
        want = model(**feed)[0].float()
        fuse_flux_epilogues(model)
        if compile:
            model.compile_repeated_blocks(fullgraph=True)
        got = model(**feed)[0].float()
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 2e-2, rel


def test_engine_flag_patches_the_served_model_and_keeps_the_image(tmp_path):
    """`ditserve generate --fused-epilogues` serves the patched blocks and draws the stock image."""
    from ditserve.cluster.cli import main
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.worker import RankWorker

    worker = RankWorker(EngineConfig(model="demo-flux", fused_epilogues=True))
    blocks = worker.pipe.transformer.single_transformer_blocks
    assert all("forward" in b.__dict__ for b in blocks)
    stock = RankWorker(EngineConfig(model="demo-flux"))
    assert not any("forward" in b.__dict__ for b in stock.pipe.transformer.single_transformer_blocks)
    args = ["generate", "a red square", "--model", "demo-flux", "--width", "64", "--height", "64"]
    assert main([*args, "-o", str(tmp_path / "a.png")]) == 0
    assert main([*args, "--fused-epilogues", "-o", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def _tanh_gelus(model) -> list:
    from diffusers.models.activations import GELU

    return [m for m in model.modules() if type(m) is GELU and m.approximate == "tanh"]


def test_engine_flag_puts_the_gelu_in_the_gemm_of_other_families():
    """Families other than FLUX.1 (here Wan) get the one part that is not FLUX-specific: every tanh-GELU MLP
    projection computes its GELU in the GEMM's epilogue; the served video is the stock one."""
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.worker import RankWorker

    fused = RankWorker(EngineConfig(model="demo-wan", fused_epilogues=True))
    stock = RankWorker(EngineConfig(model="demo-wan", fused_epilogues=False))
    gelus = _tanh_gelus(fused.pipe.transformer)
    assert len(gelus) == len(fused.pipe.transformer.blocks) > 0
    assert all("forward" in g.__dict__ for g in gelus)
    assert not any("forward" in g.__dict__ for g in _tanh_gelus(stock.pipe.transformer))


@pytest.mark.gpu
def test_bf16_gpu_gelu_epilogue_matches_the_stock_mlp():
    from diffusers.models.attention import FeedForward

    from ditserve.replica.models.flux_fused import fuse_gelu_epilogues

    torch.manual_seed(0)
    ff = FeedForward(512, inner_dim=1536, activation_fn="gelu-approximate").to("cuda", torch.bfloat16)
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = ff(x).float()
        assert fuse_gelu_epilogues(ff) == 1
        got = ff(x).float()
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 2e-2, rel
