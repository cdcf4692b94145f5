"""The MLP in sequence chunks (tiled_mlp.py): the same values and gradients as the whole MLP."""
import copy

import pytest
import torch

import hf_slideformer as hs
from hf_slideformer.compute.tiled_mlp import TiledMLP, chunk_rows, tile_mlps
from helpers import batches, make_pair, max_param_diff

LR = 1e-2


def _mlp(seed=0):
    from transformers.models.llama.modeling_llama import LlamaMLP
    from hf_slideformer.demo import tiny_config
    torch.manual_seed(seed)
    return LlamaMLP(tiny_config("llama", hidden_size=24, intermediate_size=40)).double()


@pytest.mark.parametrize("rows", [1, 3, 7, 50])
def test_tiled_mlp_equals_the_whole_mlp_forward_and_every_gradient(rows):
    mlp = _mlp()
    x = torch.randn(2, 13, 24, dtype=torch.float64, requires_grad=True)     # 13 positions: an odd split
    gy = torch.randn(2, 13, 24, dtype=torch.float64)
    want = mlp(x)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], gy)
    names = [n for n, _ in mlp.named_parameters()]
    got = TiledMLP.apply(mlp, x, rows, names, *mlp.parameters())
    got_grads = torch.autograd.grad(got, [x, *mlp.parameters()], gy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_only_the_inputs_that_need_it_get_a_gradient():
    mlp = _mlp()
    for p in mlp.parameters():
        p.requires_grad_(False)
    x = torch.randn(1, 9, 24, dtype=torch.float64, requires_grad=True)
    y = TiledMLP.apply(mlp, x, 4, [n for n, _ in mlp.named_parameters()], *mlp.parameters())
    (gx,) = torch.autograd.grad(y.sum(), [x])
    torch.testing.assert_close(gx, torch.autograd.grad(mlp(x).sum(), [x])[0])


def test_chunk_rows():
    x = torch.zeros(4, 100, 8)
    assert chunk_rows(x, 64) == 16 and chunk_rows(x, 2) == 1


def test_tile_mlps_wraps_once_and_short_inputs_run_whole():
    mlp = _mlp()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = mlp
    layer = Layer()
    tile_mlps([layer], 8)
    tile_mlps([layer], 8)
    assert layer.mlp.forward.__wrapped__.__self__ is mlp       # one wrapper, over the original forward
    x = torch.randn(1, 4, 24, dtype=torch.float64)
    torch.testing.assert_close(layer.mlp.forward(x), type(mlp).forward(mlp, x))
    wide = torch.randn(16, 5, 24, dtype=torch.float64, requires_grad=True)    # a batch wider than a chunk
    y = layer.mlp.forward(wide)                                             # runs (one position a chunk)
    torch.testing.assert_close(y, type(mlp).forward(mlp, wide))


@pytest.mark.parametrize("tied", [False, True])
def test_training_with_chunked_mlps_equals_whole_ones(tied):
    """Through the engine (forward, recompute and backward of every layer in chunks of 4 tokens
    of 2 x 11): the same training as whole MLPs, within fp32 rounding."""
    _, whole = make_pair("llama", tied)
    _, chunked = make_pair("llama", tied, mlp_chunk_tokens=4)
    data = batches(3)
    for m in (whole, chunked):
        opt = m.create_optimizer(lr=LR)
        for b in data:
            m(**b).loss.backward()
            opt.step()
            opt.zero_grad()
    assert max_param_diff(whole, chunked) < 1e-5
