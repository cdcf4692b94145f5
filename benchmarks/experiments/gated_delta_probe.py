"""Where a Qwen3.5 linear-attention layer spends its GPU time (forward + backward, one micro-batch).

    python benchmarks/experiments/gated_delta_probe.py [--batch 16] [--seq 2048]

Builds one ``Qwen3_5GatedDeltaNet`` of the qwen3.5-9b shape (bf16, random init) and times, with
CUDA events (median of 5 after 2 warm-up), the whole module and its parts: the depthwise causal
conv (cuDNN's, and in the layers' layout transformers' `causal_conv1d_fn` against
`triton_ops.causal_conv`), the chunked gated delta rule (transformers' torch path and
`triton_ops.gated_delta`), the module with the latter, with the convolution's kernel too, and
with the gated norm's kernel as well; then the 25 CUDA kernels that take the most time in one
forward + backward of transformers' module and of the module with the three kernels, under
torch.profiler.
"""
import argparse
import contextlib
import json
import statistics
import types
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

import triton_ops
from triton_ops.gated_delta import chunk_gated_delta_rule
from triton_ops.patching import _gated_norm_forward


@contextlib.contextmanager
def _conv_and_rule():
    """transformers' module with the project's gated delta rule and convolution swapped in."""
    from triton_ops.patching import _causal_conv1d_fn
    saved = q35.torch_chunk_gated_delta_rule, q35.causal_conv1d_fn
    q35.torch_chunk_gated_delta_rule, q35.causal_conv1d_fn = chunk_gated_delta_rule, _causal_conv1d_fn(saved[1])
    try:
        yield
    finally:
        q35.torch_chunk_gated_delta_rule, q35.causal_conv1d_fn = saved


def timed(fn, reps=5, warm=2):
    times = []
    for i in range(warm + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warm:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    cfg_path = Path(__file__).resolve().parents[1] / "configs" / "qwen3.5-9b.json"
    raw = json.loads(cfg_path.read_text())
    raw.pop("_comment", None)
    config = AutoConfig.for_model(**raw)
    dev = torch.device("cuda")
    net = q35.Qwen3_5GatedDeltaNet(config, layer_idx=0).to(dev, torch.bfloat16)
    x = torch.randn(args.batch, args.seq, config.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def module_fb():
        out = net(x)
        out.float().square().mean().backward()

    print(f"chunk fn: {q35.torch_chunk_gated_delta_rule}")
    print(f"causal conv fn: {getattr(q35, 'causal_conv1d_fn', None)}")
    print(f"module fwd+bwd: {timed(module_fb):.2f} ms")
    with torch.no_grad():
        print(f"module fwd only: {timed(lambda: net(x)):.2f} ms")

    h, nv, dk, dv = args.batch, config.linear_num_value_heads, 128, 128
    # The module repeats the query / key heads to the value heads before the rule (transformers 5.17
    # does it there; later versions' rule also takes fewer query / key heads).
    q = torch.randn(h, args.seq, nv, dk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(h, args.seq, nv, dk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(h, args.seq, nv, dv, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = (-torch.rand(h, args.seq, nv, device=dev)).requires_grad_()
    beta = torch.rand(h, args.seq, nv, device=dev, dtype=torch.bfloat16).requires_grad_()

    def chunk_fb():
        o, _ = q35.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o.float().square().mean().backward()

    print(f"chunk rule fwd+bwd (transformers): {timed(chunk_fb):.2f} ms")

    def own_fb():
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o.float().square().mean().backward()

    print(f"chunk rule fwd+bwd (triton_ops.gated_delta): {timed(own_fb):.2f} ms")
    leaves = (q, k, v, g, beta)
    results = []
    for rule in (q35.torch_chunk_gated_delta_rule, chunk_gated_delta_rule):
        o, _ = rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        w = torch.randn(o.shape, device=dev, generator=torch.Generator(dev).manual_seed(1))
        results.append((o.float(), torch.autograd.grad((o.float() * w).sum(), leaves)))
    (ref, ref_grads), (out, grads) = results

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    print("relative difference on CUDA: out %.2e, grads %s" % (
        rel(out, ref), " ".join(f"d{n} {rel(a, b):.2e}" for n, a, b in zip(("q", "k", "v", "g", "beta"), grads, ref_grads))))
    original = q35.torch_chunk_gated_delta_rule
    q35.torch_chunk_gated_delta_rule = chunk_gated_delta_rule
    try:
        print(f"module fwd+bwd with triton_ops.gated_delta: {timed(module_fb):.2f} ms")
    finally:
        q35.torch_chunk_gated_delta_rule = original
    conv_in = torch.randn(h, net.conv_dim, args.seq, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def conv_fb():
        y = torch.nn.functional.silu(net.conv1d(conv_in)[..., : args.seq])
        y.float().square().mean().backward()

    print(f"conv fwd+bwd: {timed(conv_fb):.2f} ms")
    # In the layers' layout: the projection's (B, T, C) output transposed, through transformers'
    # causal_conv1d_fn and through the project's kernel (triton_ops.causal_conv).
    proj = torch.randn(h, args.seq, net.conv_dim, device=dev, dtype=torch.bfloat16)
    weight = net.conv1d.weight.detach().squeeze(1).clone().requires_grad_()
    conv_grads = []
    for label, conv in (("transformers' causal_conv1d_fn", lambda t: q35.causal_conv1d_fn(t, weight, None, activation="silu")),
                        ("triton_ops.causal_conv", lambda t: triton_ops.causal_conv(t, weight, True))):
        xt = proj.clone().requires_grad_()

        def layers_fb(conv=conv, xt=xt):
            y = conv(xt.transpose(1, 2))
            y.float().square().mean().backward()

        print(f"conv fwd+bwd, the layers' layout, {label}: {timed(layers_fb):.2f} ms")
        with torch.no_grad():
            print(f"conv fwd only, the layers' layout, {label}: {timed(lambda conv=conv, xt=xt: conv(xt.transpose(1, 2))):.2f} ms")
        xt.grad, weight.grad = None, None
        y = conv(xt.transpose(1, 2))
        y.float().square().mean().backward()
        conv_grads.append((y.detach().float(), xt.grad.float(), weight.grad.float()))
    print("conv relative difference (kernel vs transformers): y %.2e dx %.2e dw %.2e" % tuple(
        rel(a, b) for a, b in zip(conv_grads[1], conv_grads[0])))
    with _conv_and_rule():
        print(f"module fwd+bwd with triton_ops.gated_delta and triton_ops.causal_conv: {timed(module_fb):.2f} ms")
        net.norm.forward = types.MethodType(_gated_norm_forward, net.norm)
        try:
            print(f"module fwd+bwd with those and triton_ops.gated_rms_norm: {timed(module_fb):.2f} ms")
            with torch.no_grad():
                print(f"module fwd only with the three: {timed(lambda: net(x)):.2f} ms")
        finally:
            del net.norm.forward

    from torch.profiler import ProfilerActivity, profile
    for label in ("transformers' module", "the project's rule, convolution and gated norm"):
        with contextlib.ExitStack() as stack:
            if label.startswith("the project"):
                stack.enter_context(_conv_and_rule())
                net.norm.forward = types.MethodType(_gated_norm_forward, net.norm)
                stack.callback(delattr, net.norm, "forward")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                module_fb()
                torch.cuda.synchronize()
        print(f"module fwd+bwd with {label}: the CUDA kernels by time")
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        print("\n".join(line[:70] + line[-95:] for line in table.splitlines()))


if __name__ == "__main__":
    main()
