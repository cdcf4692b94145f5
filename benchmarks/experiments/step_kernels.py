#!/usr/bin/env python
"""Where the GPU time of one slid training step goes, kernel by kernel.

    python benchmarks/experiments/step_kernels.py --model llama3-8b --layers 8 --batch 16 --cap-gib 12

Builds the shape (with `--layers` decoder layers, so that the host state stays small), slides it,
runs warm-up steps, then one step under torch.profiler (CUDA activity only). Prints the GPU time
by kind of kernel (GEMM, attention, Triton, copies, other) and the kernels that take the most,
per decoder layer where the kernel runs once per layer. `--attention` picks the SDPA back end.
"""
from __future__ import annotations

import argparse
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
    for k, pat in KINDS:
        if pat.search(name):
            return k
    return "other"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--cap-gib", type=float, default=12.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--slide-config", default="{}")
    p.add_argument("--attention", default="default", choices=["default", "flash", "cudnn", "efficient"])
    args = p.parse_args()
    import json

    import hf_slideformer as hs

    config = load_config(args.model)
    config.num_hidden_layers = args.layers
    model = build_model(config, "cpu", torch.bfloat16, fill="tiled")
    cfg = hs.SlideConfig(device="cuda", dtype=torch.bfloat16, gpu_memory_limit=args.cap_gib,
                         **json.loads(args.slide_config))
    model = hs.slide(model, cfg)
    opt = model.create_optimizer(lr=1e-5)
    ids, labels = random_batch(config.vocab_size, args.batch, args.seq, torch.device("cuda"))

    if args.attention != "default":
        from torch.nn.attention import SDPBackend
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            getattr(torch.backends.cuda, f"enable_{'mem_efficient' if name == 'efficient' else name}_sdp")(
                name == args.attention)

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
    plain_ms = start.elapsed_time(end)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = ev.time_range.elapsed_us() / 1e3
        by_name[ev.name][0] += dur
        by_name[ev.name][1] += 1
        spans.append((ev.time_range.start, ev.time_range.end, kind_of(ev.name)))
    # Busy time: the union of the compute kernels' intervals (copies run beside them on other streams).
    busy, last = 0.0, None
    for a, b, k in sorted(s for s in spans if s[2] != "memcpy"):
        if last is None or a > last:
            busy += (b - a) / 1e3
            last = b
        elif b > last:
            busy += (b - last) / 1e3
            last = b
    by_kind: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        by_kind[kind_of(name)] += ms
    print(f"{args.model} with {args.layers} layers, batch {args.batch} x {args.seq}, cap {args.cap_gib} GiB: "
          f"step {plain_ms:.1f} ms unprofiled; compute kernels busy {busy:.1f} ms (union)")
    for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {ms:9.1f} ms  ({ms / args.layers:7.2f} per layer)")
    print(f"top {args.top} kernels (total ms, calls, name):")
    for name, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {ms:9.2f} {n:5d}  [{kind_of(name)}] {name[:110]}")


if __name__ == "__main__":
    main()
