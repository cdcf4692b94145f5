#!/usr/bin/env python
"""Where the GPU time of one slid training step goes, kernel by kernel, and the matmuls' rate.

    python benchmarks/experiments/step_kernels.py --model llama3-8b --layers 8 --batch 16 --cap-gib 12
    python benchmarks/experiments/step_kernels.py --layers 2 --vocab 8192 --matmuls dtype,fp8 --json k.json

Builds the shape (with `--layers` decoder layers, so that the host state stays small; `--vocab`
shrinks the head too), slides it, runs warm-up steps, then one step under torch.profiler (CUDA
activity only), once per `--matmuls` mode (`SlideConfig.matmuls`: the compute dtype, or FP8
projections, docs/fp8.md). Prints the GPU time by kind of kernel (GEMM, attention, Triton,
copies, other) and the kernels that take the most, per decoder layer where the kernel runs once
per layer, and the matmuls' rate: the step's GEMM FLOPs (`gemm_flops`) over the GEMM kernels'
time. `--attention` picks the SDPA back end.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from benchmarks.providers.base import build_model, load_config, random_batch  # noqa: E402

KINDS = [("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),     # cuDNN's SDPA kernels name sm90 too
         ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|cublas", re.I)),
         ("memcpy", re.compile(r"memcpy|memset", re.I)),
         ("triton", re.compile(r"^_|triton", re.I)),
         ("elementwise/reduce (aten)", re.compile(r".*"))]


def kind_of(name: str) -> str:
    """The kind a CUDA kernel's name files it under (the first pattern of KINDS that matches)."""
    for k, pat in KINDS:
        if pat.search(name):
            return k
    return "other"


def gemm_flops(model, tokens: int) -> dict[str, float]:
    """The GEMM FLOPs of one slid step over `tokens` tokens: each decoder layer's projections
    (`layer_matmuls.projections`, N parameters, its last one N_last) 2N per token in the forward,
    2(N - N_last) in the recompute (which skips the last projection), 4N in the backward; the
    loss head's three matmuls (logits, dh, dW) 6HV per token. Attention's matmuls (inside SDPA)
    are not counted."""
    from hf_slideformer.compute.layer_matmuls import projections
    layers = 0.0
    for layer in model.model.layers:
        proj = projections(layer)
        n = sum(p.weight.numel() for p in proj)
        layers += tokens * (8 * n - 2 * proj[-1].weight.numel())
    head = 6.0 * tokens * model.lm_head.weight.numel()
    return {"layers": layers, "head": head, "total": layers + head}


def profile_step(step) -> tuple[dict[str, list[float]], float]:
    """One call of `step` under torch.profiler: {kernel name: [ms, calls]} and the compute kernels'
    busy time (the union of their intervals; copies run beside them on other streams)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_name[ev.name][0] += ev.time_range.elapsed_us() / 1e3
        by_name[ev.name][1] += 1
        spans.append((ev.time_range.start, ev.time_range.end, kind_of(ev.name)))
    busy, last = 0.0, None
    for a, b, k in sorted(s for s in spans if s[2] != "memcpy"):
        if last is None or a > last:
            busy += (b - a) / 1e3
            last = b
        elif b > last:
            busy += (b - last) / 1e3
            last = b
    return dict(by_name), busy


def measure(args, matmuls: str) -> dict:
    """Slide the shape with `matmuls`, warm up, time one step, profile one: the mode's figures."""
    import hf_slideformer as hs

    config = load_config(args.model)
    config.num_hidden_layers = args.layers
    if args.vocab:
        config.vocab_size = args.vocab
    model = build_model(config, "cpu", torch.bfloat16, fill="tiled")
    flops = gemm_flops(model, args.batch * args.seq)
    cfg = hs.SlideConfig(device="cuda", dtype=torch.bfloat16, gpu_memory_limit=args.cap_gib, matmuls=matmuls,
                         **json.loads(args.slide_config))
    model = hs.slide(model, cfg)
    opt = model.create_optimizer(lr=1e-5)
    ids, labels = random_batch(config.vocab_size, args.batch, args.seq, torch.device("cuda"))

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    by_name, busy = profile_step(step)
    model.slide_engine.close()
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()                       # the next mode starts from an empty device
    by_kind: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        by_kind[kind_of(name)] += ms
    gemm_ms = by_kind.get("gemm", 0.0)
    return {"matmuls": matmuls, "step_ms": start.elapsed_time(end), "busy_ms": busy, "by_kind_ms": dict(by_kind),
            "gemm_flops": flops, "gemm_tflops": flops["total"] / gemm_ms / 1e9 if gemm_ms else None,
            "top": sorted(([n, ms, c] for n, (ms, c) in by_name.items()), key=lambda t: -t[1])[:args.top]}


def report(args, fig: dict) -> None:
    """One mode's breakdown: the step, the kinds (per layer too), the GEMM rate, the top kernels."""
    print(f"{args.model} with {args.layers} layers, batch {args.batch} x {args.seq}, cap {args.cap_gib} GiB, "
          f"matmuls={fig['matmuls']}: step {fig['step_ms']:.1f} ms unprofiled; compute kernels busy "
          f"{fig['busy_ms']:.1f} ms (union)")
    for k, ms in sorted(fig["by_kind_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {ms:9.1f} ms  ({ms / args.layers:7.2f} per layer)")
    flops = fig["gemm_flops"]
    print(f"  matmuls: {flops['layers'] / args.layers:.3e} FLOP per layer, the head's {flops['head']:.3e}: "
          f"{fig['gemm_tflops'] or 0:.0f} TFLOP/s over the GEMM kernels' time")
    print(f"top {args.top} kernels (total ms, calls, name):")
    for name, ms, n in fig["top"]:
        print(f"  {ms:9.2f} {n:5d}  [{kind_of(name)}] {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=0, help="the head's vocabulary (0: the model's)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--cap-gib", type=float, default=12.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--matmuls", default="dtype", help="comma-separated SlideConfig.matmuls modes, each measured")
    p.add_argument("--slide-config", default="{}")
    p.add_argument("--attention", default="default", choices=["default", "flash", "cudnn", "efficient"])
    p.add_argument("--json", help="where to write every mode's figures")
    args = p.parse_args()
    if args.attention != "default":
        for name in ("flash", "cudnn", "efficient"):
            getattr(torch.backends.cuda, f"enable_{'mem_efficient' if name == 'efficient' else name}_sdp")(
                name == args.attention)
    figures = []
    for matmuls in args.matmuls.split(","):
        figures.append(measure(args, matmuls))
        report(args, figures[-1])
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "modes": figures, "torch": torch.__version__,
                                               "gpu": torch.cuda.get_device_name()}, indent=1))
    if len(figures) > 1:
        print("\n| matmuls | step ms | busy ms | GEMM ms | GEMM TFLOP/s | attention ms | triton ms | aten ms |")
        print("|---|---|---|---|---|---|---|---|")
        for fig in figures:
            kinds = fig["by_kind_ms"]
            print(f"| {fig['matmuls']} | {fig['step_ms']:.1f} | {fig['busy_ms']:.1f} | {kinds.get('gemm', 0):.1f} | "
                  f"{fig['gemm_tflops'] or 0:.0f} | {kinds.get('attention', 0):.1f} | {kinds.get('triton', 0):.1f} | "
                  f"{kinds.get('elementwise/reduce (aten)', 0):.1f} |")


if __name__ == "__main__":
    main()
