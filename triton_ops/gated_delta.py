"""The chunked gated delta rule (Qwen3.5's linear attention) with a hand-written backward for the
scan over chunks.

`chunk_gated_delta_rule` takes the arguments of transformers' `torch_chunk_gated_delta_rule` and
computes the same mathematics, in fp32 as it does (the queries' and keys' L2 norm through
`triton_ops.qk_l2norm`, a kernel where the kernels apply, else transformers' ops): the work inside
each chunk (decays, the UT transform through its triangular inverse, the within-chunk attention)
in batched torch ops under autograd, and the sequential part, the recurrent state carried from
chunk to chunk, as one autograd function (`_ChunkScan`) whose loop over chunks is torch's batched
products (a Triton kernel per direction measured no faster: docs/kernels.md).

Note: [Why the scan has its own backward] transformers' loop over chunks writes each chunk's
output into a slice of one tensor and builds about ten autograd nodes per chunk; the backward of
each slice write copies the whole output gradient. Here the loop keeps only what depends on the
previous chunk: per chunk, the new values' correction and the state update (two matmuls each way).
The state entering every chunk is kept (as autograd keeps it), and everything that does not depend
on the next chunk's state (the outputs; the gradients of the queries, the within-chunk attention,
the corrected values and the keys) is one batched product over all chunks before or after the
loop.

With per chunk c the state S_c entering it, the decayed queries Q_c and keys K_c, the solved
values U_c and decayed keys W_c, the within-chunk attention A_c (lower triangular) and the chunk's
decay y_c:

    V_c = U_c - W_c S_c,   O_c = Q_c S_c + A_c V_c,   S_{c+1} = y_c S_c + K_c^T V_c

and backward, with G_c = dL/dS_c (G_n the final state's gradient):

    dV_c = A_c^T dO_c + K_c G_{c+1},   G_c = y_c G_{c+1} + Q_c^T dO_c - W_c^T dV_c
    dQ_c = dO_c S_c^T,  dA_c = dO_c V_c^T,  dK_c = V_c G_{c+1}^T,  dU_c = dV_c,
    dW_c = -dV_c S_c^T,  dy_c = <G_{c+1}, S_c>
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import triton_ops

__all__ = ["chunk_gated_delta_rule"]


class _ChunkScan(torch.autograd.Function):
    """(O, final state) from the per-chunk tensors (the module docstring's symbols); shapes
    Q, K, W (b, h, n, C, Dk), U (b, h, n, C, Dv), A (b, h, n, C, C), y (b, h, n), S0 (b, h, Dk, Dv)."""

    @staticmethod
    def forward(ctx, query, key, new_values, k_cumdecay, attn, chunk_decay, initial_state):
        device = query.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        states, corrected, state = _ChunkScan._scan(key, new_values, k_cumdecay, chunk_decay, initial_state)
        out = query @ states + attn @ corrected
        ctx.save_for_backward(query, key, k_cumdecay, attn, chunk_decay, states, corrected)
        return out, state

    @staticmethod
    def _scan(key, new_values, k_cumdecay, chunk_decay, state):
        """The forward loop: (states entering each chunk, corrected values, final state)."""
        n = key.shape[2]
        states = key.new_empty(key.shape[:3] + (key.shape[-1], new_values.shape[-1]))
        corrected = torch.empty_like(new_values)
        for c in range(n):
            states[:, :, c] = state
            corrected[:, :, c] = new_values[:, :, c] - k_cumdecay[:, :, c] @ state
            state = state * chunk_decay[:, :, c, None, None] + key[:, :, c].transpose(-1, -2) @ corrected[:, :, c]
        return states, corrected, state

    @staticmethod
    def _scan_back(key, k_cumdecay, chunk_decay, from_out, q_out, d_final):
        """The backward loop: (G_{c+1} per chunk, dV per chunk, the initial state's gradient)."""
        n = key.shape[2]              # buffers in the keys' dtype, as the forward's (not autocast's)
        grad = key.new_zeros(q_out.shape[:2] + q_out.shape[3:]) if d_final is None else d_final.clone()
        d_corrected = key.new_empty(from_out.shape)
        next_grads = key.new_empty(q_out.shape)
        for c in range(n - 1, -1, -1):
            next_grads[:, :, c] = grad
            d_corrected[:, :, c] = from_out[:, :, c] + key[:, :, c] @ grad
            grad = (grad * chunk_decay[:, :, c, None, None] + q_out[:, :, c]
                    - k_cumdecay[:, :, c].transpose(-1, -2) @ d_corrected[:, :, c])
        return next_grads, d_corrected, grad

    @staticmethod
    def backward(ctx, d_out, d_final):
        # Under the forward's autocast state, as autograd runs the backward of autocast ops: the
        # products in the autocast dtype, the sums where their operands meet.
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _ChunkScan._backward(ctx, d_out, d_final)

    @staticmethod
    def _backward(ctx, d_out, d_final):
        query, key, k_cumdecay, attn, chunk_decay, states, corrected = ctx.saved_tensors
        d_out = d_out.contiguous()
        from_out = attn.transpose(-1, -2) @ d_out                   # A_c^T dO_c
        q_out = query.transpose(-1, -2) @ d_out                     # Q_c^T dO_c
        next_grads, d_corrected, grad = _ChunkScan._scan_back(key, k_cumdecay, chunk_decay, from_out, q_out, d_final)
        states_t = states.transpose(-1, -2)
        d_query = d_out @ states_t
        d_key = corrected @ next_grads.transpose(-1, -2)
        d_k_cumdecay = -(d_corrected @ states_t)
        d_attn = d_out @ corrected.transpose(-1, -2)
        d_chunk_decay = (next_grads * states).sum((-1, -2))
        return d_query, d_key, d_corrected, d_k_cumdecay, d_attn, d_chunk_decay, grad


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule by chunks: transformers' `torch_chunk_gated_delta_rule`, same arguments
    and results (its docstring), the scan over chunks with its own backward (module note).

    Args:
        query, key: (batch, seq, k_heads, k_dim); value: (batch, seq, v_heads, v_dim), v_heads a
            multiple of k_heads (each query/key head serves v_heads // k_heads value heads).
        g: (batch, seq, v_heads) log decays (<= 0); beta: (batch, seq, v_heads).
        chunk_size: tokens per chunk.
        initial_state: (batch, v_heads, k_dim, v_dim) or None (zeros).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalize queries and keys first (fp32, eps 1e-6).
        kwargs: ignored, as the torch path ignores them (`cu_seqlens`: packed sequences are not
            separated by this path either).

    Returns:
        (output (batch, seq, v_heads, v_dim) in the query's dtype, final state or None).
    """
    initial_dtype = query.dtype
    batch, seq, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    if use_qk_l2norm_in_kernel:           # repeat, heads first in fp32, normalize, scale: one kernel each
        query = triton_ops.qk_l2norm(query, v_heads // k_heads, k_dim ** -0.5)
        key = triton_ops.qk_l2norm(key, v_heads // k_heads)
    else:
        if k_heads != v_heads:
            query = query.repeat_interleave(v_heads // k_heads, dim=2)
            key = key.repeat_interleave(v_heads // k_heads, dim=2)
        query, key = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                      for x in (query, key)]
        query = query * k_dim ** -0.5
    value, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                          for x in (value, beta, g)]
    pad = (chunk_size - seq % chunk_size) % chunk_size
    if pad:                               # (a pad of zero would still copy each tensor)
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    attn = (query @ key.transpose(-1, -2)) * pairwise
    from_start = cum_decay.exp().unsqueeze(-1)       # each token's decay since its chunk's start (<= 1)
    decayed_k_beta = k_beta * from_start
    # The UT transform through its inverse, as transformers' path forms it: one solve against the
    # identity (chunk-wide right-hand sides) and two batched products, cheaper than two solves of
    # the value- and key-wide right-hand sides forward and backward (docs/kernels.md).
    eye = torch.eye(chunk_size, dtype=ut_system.dtype, device=ut_system.device).expand_as(ut_system)
    ut_inverse = torch.linalg.solve_triangular(ut_system, eye, upper=False, unitriangular=True)
    new_values = ut_inverse @ v_beta
    k_cumdecay = ut_inverse @ decayed_k_beta
    state = (torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=query.device)
             if initial_state is None else initial_state.to(torch.float32))
    query = query * from_start
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    out, state = _ChunkScan.apply(query, key, new_values, k_cumdecay, attn, cum_decay[..., -1].exp(), state)
    out = out.reshape(batch, v_heads, -1, v_dim)[:, :, :seq]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)
