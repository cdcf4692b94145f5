"""FP8 quality: one Llama-shaped model trained in bf16 and with its projections in FP8, same seed
and data, loss curves side by side.

    python3 benchmarks/fp8_quality.py --steps 500 --json fp8_quality.json

The model (default ~1.1 B parameters: hidden 2048, 16 layers, 16 heads, 8 kv heads, intermediate
8192, vocab 32000) starts from the same random weights in both runs and trains on the bundled
corpus (hf_slideformer/data/corpus.txt, repeated: blocks of `--seq` tokens drawn by one seeded
generator), with AdamW and a linear warm-up. Both runs slide the model (`hs.slide`) on the GPU,
the second with `SlideConfig(matmuls="fp8")` (docs/fp8.md). Printed: both curves every
`--log-every` steps and the largest relative gap |fp8 - bf16| / bf16 after `--warmup` steps;
the JSON holds every step's losses, the gap and the versions; `--svg` draws both curves (the
figure docs/benchmarks.md shows). `--max-seconds` bounds the whole run: the bf16 arm stops at
half of it, and the FP8 arm runs the steps the bf16 arm made (both curves always cover the same
steps; the output says when they are fewer than `--steps`). `--emulate` runs the FP8 arm through
the recipe's CPU emulation instead (a smoke test on a machine without FP8 tensor cores).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import hf_slideformer as hs  # noqa: E402
from hf_slideformer.demo import token_blocks, train_tokenizer  # noqa: E402


def model_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                       vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False,
                       use_cache=False)


def corpus_batches(args) -> list[torch.Tensor]:
    """`--steps` batches of (batch, seq) token ids from the corpus, the same for both runs."""
    tok = train_tokenizer(vocab_size=min(args.vocab, 4096))
    stream = token_blocks(tok, block=1).reshape(-1)                   # the corpus's tokens, in order
    reps = -(-(args.seq + 1) * 4 // stream.numel()) + 1
    stream = stream.repeat(max(1, reps))
    gen = torch.Generator().manual_seed(args.seed + 1)
    starts = torch.randint(0, stream.numel() - args.seq, (args.steps, args.batch), generator=gen)
    return [torch.stack([stream[s:s + args.seq] for s in row.tolist()]) for row in starts]


def initial_model(args, device: str):
    """Random weights (normal(0, 0.02), norms 1), made on `device` from `--seed`, returned on the CPU."""
    from benchmarks.providers.base import build_model
    return build_model(model_config(args), device, torch.bfloat16, fill="normal", seed=args.seed).cpu()


def train_arm(args, matmuls: str, data: list[torch.Tensor], device: str, seconds: float = float("inf")) -> list[float]:
    """The losses of training on `data` in order, stopping after the step that ends past `seconds`."""
    model = initial_model(args, device)
    emulate = matmuls == "fp8" and args.emulate
    cfg = hs.SlideConfig(device=device, dtype=torch.bfloat16, matmuls="dtype" if emulate else matmuls)
    model = hs.slide(model, cfg)
    if emulate:
        from hf_slideformer.layer_matmuls import install_emulation
        install_emulation(model)
    opt = model.create_optimizer(lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    losses = []
    t0 = time.perf_counter()
    for n, ids in enumerate(data):
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (n + 1) % args.log_every == 0:
            print(f"  {matmuls:5s} step {n + 1:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        if time.perf_counter() - t0 > seconds:
            print(f"  {matmuls:5s} stopped after step {n + 1}: {seconds:.0f} s reached", flush=True)
            break
    model.slide_engine.close()
    del model, opt
    gc.collect()
    return losses


def gap_after(a: list[float], b: list[float], warmup: int) -> tuple[float, int]:
    """The largest |b - a| / a after `warmup` steps, and its step (1-based)."""
    gaps = [(abs(y - x) / abs(x), i + 1) for i, (x, y) in enumerate(zip(a, b)) if i >= warmup]
    return max(gaps) if gaps else (0.0, 0)


def write_svg(path: str, curves: dict[str, list[float]], warmup: int) -> None:
    """Both loss curves against the step, as one SVG line chart (no plotting library needed)."""
    w, h, pad = 640, 360, 48
    allv = [v for c in curves.values() for v in c[warmup // 2:]]
    lo, hi = min(allv), max(allv)
    n = max(len(c) for c in curves.values())

    def xy(i, v):
        return pad + (w - 2 * pad) * i / max(1, n - 1), h - pad - (h - 2 * pad) * (v - lo) / max(hi - lo, 1e-9)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">step (1 to {n})</text>',
           f'<text x="{pad - 4}" y="{pad}" text-anchor="end">{hi:.2f}</text>',
           f'<text x="{pad - 4}" y="{h - pad}" text-anchor="end">{lo:.2f}</text>']
    for (name, c), color, y in zip(curves.items(), ("#1f77b4", "#d62728"), (pad - 20, pad - 6)):
        pts = " ".join(f"{x:.1f},{yy:.1f}" for x, yy in (xy(i, v) for i, v in enumerate(c) if i >= warmup // 2))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{pts}"/>')
        out.append(f'<text x="{w - pad}" y="{y}" text-anchor="end" fill="{color}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (linear lr), excluded from the gap")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--emulate", action="store_true", help="the FP8 arm through the CPU emulation (smoke test)")
    p.add_argument("--max-seconds", type=float, default=280,
                   help="the whole run's time: the bf16 arm stops at half, the FP8 arm makes as many steps")
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--svg", help="where to draw both loss curves (SVG)")
    args = p.parse_args(argv)
    data = corpus_batches(args)
    curves = {}
    for arm in ("dtype", "fp8"):
        print(f"{arm}: {len(data)} steps of {args.batch} x {args.seq} tokens", flush=True)
        curves[arm] = train_arm(args, arm, data, args.device, args.max_seconds / 2 if arm == "dtype" else float("inf"))
        data = data[:len(curves[arm])]                  # the FP8 arm covers the steps the bf16 arm made
    steps = len(data)
    if steps < args.steps:
        print(f"both arms ran {steps} of {args.steps} steps (--max-seconds {args.max_seconds:.0f})")
    gap, at = gap_after(curves["dtype"], curves["fp8"], args.warmup)
    print(f"\n{'step':>6} {'bf16':>9} {'fp8':>9} {'rel gap':>8}")
    for i in range(args.log_every - 1, steps, args.log_every):
        a, b = curves["dtype"][i], curves["fp8"][i]
        print(f"{i + 1:6d} {a:9.4f} {b:9.4f} {abs(b - a) / abs(a):8.2%}")
    print(f"max relative gap after step {args.warmup}: {gap:.2%} (step {at})")
    if args.svg:
        write_svg(args.svg, {"bf16": curves["dtype"], "fp8": curves["fp8"]}, args.warmup)
    doc = {"args": vars(args), "steps_run": steps, "bf16": curves["dtype"], "fp8": curves["fp8"],
           "max_rel_gap_after_warmup": gap, "max_gap_step": at, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "fp8_emulated": args.emulate}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
