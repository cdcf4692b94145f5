"""The MLP of a decoder layer in sequence chunks: what lets long sequences fit the GPU.

At long sequences a layer's MLP intermediates dominate its memory: B * S * intermediate values for
the gate, the up projection and their product (at 8B and 128k tokens, 3.7 GB each in bf16),
while the layer's input is B * S * hidden. The MLP acts on every position alone, so it can run
chunk by chunk along the sequence: `TiledMLP` keeps only its input, computes the output a chunk
at a time, and in backward recomputes each chunk with gradients, so the intermediates of one
chunk are alive at a time. The loss head already chunks (`head_chunk_tokens`); attention stays
whole (its kernels are memory-efficient).

`tile_mlps(layers, chunk_tokens)` wraps each layer's `mlp.forward` (HF's, or the fused kernel's
installed before it): the forward without gradients loops over the chunks, the recompute with
gradients goes through `TiledMLP`. The parameter gradients are summed over the chunks, so they
equal the whole MLP's within fp32 rounding (tests/test_tiled_mlp.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["TiledMLP", "tile_mlps", "chunk_rows"]


def chunk_rows(x: torch.Tensor, chunk_tokens: int) -> int:
    """Sequence positions per chunk of x (B, S, H): about `chunk_tokens` tokens, at least one."""
    batch = x.numel() // (x.shape[-2] * x.shape[-1]) if x.dim() >= 2 else 1
    return max(1, chunk_tokens // max(1, batch))


class TiledMLP(torch.autograd.Function):
    """y = mlp(x) computed `rows` sequence positions at a time, keeping only x for backward.

    Args of `apply`: the MLP module, x (B, S, H), rows per chunk, the names of its parameters,
    then those parameters as the forward reads them (its weights, a LoRA adapter's), so that
    autograd hands their gradients back. The backward recomputes each chunk with these same
    tensors (`torch.func.functional_call`): by then the module may hold others (the engine puts
    its masters back once a layer's graph is built).
    """

    @staticmethod
    def forward(ctx, mlp, x, rows, names, *params):
        ctx.mlp, ctx.rows, ctx.names = mlp, rows, names
        ctx.save_for_backward(x, *params)
        # The chunks' dropout masks (a LoRA adapter's) are drawn again in backward from this state.
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        with torch.no_grad():
            return torch.cat([mlp(c) for c in x.split(rows, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, gy):
        x, *params = ctx.saved_tensors
        wrt = [k for k, p in enumerate(params) if ctx.needs_input_grad[4 + k]]
        bound = dict(zip(ctx.names, params))
        gx = torch.empty_like(x) if ctx.needs_input_grad[1] else None
        gp: list[torch.Tensor | None] = [None] * len(params)     # summed over the chunks in fp32
        start = 0
        cpu_state, cuda_state = ctx.rng
        with torch.random.fork_rng(devices=[x.device] if cuda_state is not None else []):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, x.device)
            for chunk, gy_chunk in zip(x.split(ctx.rows, dim=-2), gy.split(ctx.rows, dim=-2)):
                xc = chunk.detach().requires_grad_(gx is not None)
                with torch.enable_grad():
                    yc = torch.func.functional_call(ctx.mlp, bound, (xc,), strict=False)
                inputs = ([xc] if gx is not None else []) + [params[k] for k in wrt]
                grads = torch.autograd.grad(yc, inputs, gy_chunk, allow_unused=True)
                if gx is not None:
                    gx.narrow(-2, start, chunk.shape[-2]).copy_(grads[0])
                    grads = grads[1:]
                for index, gk in zip(wrt, grads):
                    if gk is not None:
                        wide = torch.promote_types(gk.dtype, torch.float32)     # bf16 sums in fp32
                        gp[index] = gk.to(wide) if gp[index] is None else gp[index].add_(gk)
                start += chunk.shape[-2]
        gp = [g.to(p.dtype) if g is not None else None for g, p in zip(gp, params)]
        return (None, gx, None, None, *gp)


def _tiled(mlp: nn.Module, forward, chunk_tokens: int):
    def tiled_forward(x, *args, **kwargs):
        if args or kwargs or x.dim() < 3 or x.numel() // x.shape[-1] <= chunk_tokens:
            return forward(x, *args, **kwargs)
        rows = chunk_rows(x, chunk_tokens)
        if rows >= x.shape[-2]:                      # one position per chunk is the finest split
            return forward(x)
        if not torch.is_grad_enabled():
            return torch.cat([forward(c) for c in x.split(rows, dim=-2)], dim=-2)
        named = list(mlp.named_parameters())         # as swapped in now: slot views, leaves, adapters
        return TiledMLP.apply(mlp, x, rows, [n for n, _ in named], *[p for _, p in named])
    tiled_forward.__wrapped__ = forward
    return tiled_forward


def tile_mlps(layers, chunk_tokens: int | None) -> None:
    """Make each layer's MLP run in chunks of about `chunk_tokens` tokens (None: leave them)."""
    if chunk_tokens is None:
        return
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and not hasattr(mlp.forward, "__wrapped__"):
            mlp.forward = _tiled(mlp, mlp.forward, chunk_tokens)
