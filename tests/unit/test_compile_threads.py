"""--compile with the engine's two threads: a realtime chunk's VAE decode runs on a thread of its own (its
norms a compiled function) while the step loop runs, and compiles, the transformer's blocks. FX tracing sets
a process-wide "tracing" flag, and a compiled function called from another thread meanwhile raised
"Detected that you are using FX to symbolically trace a dynamo-optimized function": under torch 2.11 on a
GPU, where decode and steps overlap, the first chunks of a compiled realtime session failed so."""

import threading

import torch
import torch.fx
from diffusers import FluxTransformer2DModel

from ditserve.replica.pipelines.anyflow import compiled_rms_norm, rms_norm
from ditserve.replica.worker import compile_blocks


class _HoldsTheTrace(torch.nn.Module):
    """A module whose FX trace waits, mid-trace, until told to finish."""

    def __init__(self) -> None:
        super().__init__()
        self.tracing, self.finish = threading.Event(), threading.Event()

    def forward(self, x):
        self.tracing.set()
        assert self.finish.wait(timeout=60)
        return x + 1


def test_the_decoders_compiled_norm_runs_while_another_thread_traces():
    model = FluxTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    compile_blocks(model)  # what --compile does before a realtime session's first chunk
    x, gamma = torch.randn(1, 8, 2, 4, 4), torch.rand(8, 1, 1, 1)
    norm = compiled_rms_norm()
    expected = rms_norm(x, gamma, 0.0, True)
    torch.testing.assert_close(norm(x, gamma, 0.0, True), expected)

    holder = _HoldsTheTrace()
    traced: list[torch.fx.GraphModule] = []
    tracer = threading.Thread(target=lambda: traced.append(torch.fx.symbolic_trace(holder)))
    tracer.start()
    try:
        assert holder.tracing.wait(timeout=60)
        # The decode thread's call while the other thread's trace is on.
        torch.testing.assert_close(norm(x, gamma, 0.0, True), expected)
    finally:
        holder.finish.set()
        tracer.join(timeout=60)
    assert traced and torch.equal(traced[0](x), x + 1)  # the trace itself is undisturbed
