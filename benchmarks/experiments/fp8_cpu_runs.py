"""The FP8 recipe on a CPU, in the slid model and in a plain HF model, at the tiny shape of
docs/benchmarks.md ("FP8 quality"): does the engine compute what the recipe computes, and how far
apart are single runs where the loss falls steeply?

    python3 benchmarks/experiments/fp8_cpu_runs.py step      # one step: loss and every projection's gradient norms
    python3 benchmarks/experiments/fp8_cpu_runs.py steps     # 12 steps at a constant lr: the losses
    python3 benchmarks/experiments/fp8_cpu_runs.py fall      # 40 steps through the steep fall: train losses every 10

The FP8 arms run the engine's recipe through its CPU emulation (`EmulatedFp8`): in the slid model
(`install_emulation`, compute in fp32) and in a plain HF model whose decoder linears call the same
`Fp8Linear`. `fall` also trains the plain model in fp32 and, where torchao is installed, with
torchao's rowwise recipe under bf16 autocast beside its plain bf16-autocast run (torch's CPU
`_scaled_mm`). The data and the shape are `fp8_quality.py`'s (grammar stream, hidden 256, 4
layers), lr 1e-3.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import benchmarks.fp8_quality as quality  # noqa: E402
import hf_slideformer as hs  # noqa: E402
from hf_slideformer.compute.fp8 import EmulatedFp8, Fp8Linear  # noqa: E402
from hf_slideformer.compute.layer_matmuls import install_emulation  # noqa: E402

SHAPE = ["--batch", "8", "--seq", "128", "--hidden", "256", "--layers", "4", "--heads", "4", "--kv-heads", "2",
         "--intermediate", "1024", "--device", "cpu", "--emulate", "--json", "unused"]


def plain(base, fp8: bool):
    """A copy of `base` (fp32), its decoder linears through the recipe's emulation when `fp8`."""
    model = copy.deepcopy(base)
    if fp8:
        ops = EmulatedFp8()
        for mod in model.model.layers.modules():
            if isinstance(mod, nn.Linear):
                mod.forward = (lambda m: (lambda x: Fp8Linear.apply(x, m.weight, m.bias, None, ops, True)))(mod)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


def slid(base, fp8: bool):
    """`base` slid in fp32, its projections through the recipe's emulation when `fp8`."""
    model = hs.slide(copy.deepcopy(base), hs.SlideConfig(device="cpu", dtype=torch.float32, matmuls="dtype"))
    if fp8:
        install_emulation(model)
    return model, model.create_optimizer(lr=1e-3, weight_decay=0.0)


def train(qargs, model, opt, data, blocks, name: str, autocast: bool = False) -> list[float]:
    """`fp8_quality.train_steps` (its warm-up and logging); the mean train loss over each logged window."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else None
    losses = quality.train_steps(qargs, model, opt, data, blocks, "cpu", float("inf"), name, autocast=ctx)["train"]
    if hasattr(model, "slide_engine"):
        model.slide_engine.close()
    every = qargs.log_every
    return [sum(losses[i:i + every]) / every for i in range(0, len(losses), every)]


def one_step(base, ids) -> None:
    norms = {}
    original = Fp8Linear.backward

    def recorded(ctx, gy):
        grads = original(ctx, gy)
        norms.setdefault(name, []).append(tuple(None if g is None else g.norm().item() for g in grads[:2]))
        return grads

    Fp8Linear.backward = staticmethod(recorded)
    try:
        losses = {}
        for name, make in (("plain", plain), ("slid", slid)):
            model, _ = make(base, True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses[name] = loss.item()
            if hasattr(model, "slide_engine"):
                model.slide_engine.close()
    finally:
        Fp8Linear.backward = staticmethod(original)
    worst = max(abs(a - b) / abs(b) for p, s in zip(norms["plain"], norms["slid"]) for a, b in zip(s, p)
                if a is not None and b)
    print(f"loss plain {losses['plain']:.6f} slid {losses['slid']:.6f}; {len(norms['slid'])} projection backwards, "
          f"largest relative difference of a gradient norm {worst:.1e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("step", "steps", "fall"))
    args = p.parse_args(argv)
    steps = {"step": 1, "steps": 12, "fall": 40}[args.part]
    warmup, every = (0, 1) if args.part != "fall" else (10, 10)
    qargs = quality.parse_args(SHAPE + ["--lr", "1e-3", "--warmup", str(warmup), "--log-every", str(every)])
    tokenizer = quality.train_tokenizer(vocab_size=4096)
    blocks = quality.held_out_blocks(quality.corpus_split(tokenizer)[1], 128)
    stream, _ = quality.grammar_stream(tokenizer, quality.corpus_grammar(), steps * 8 * 128, qargs.seed + 2)
    data = quality.grammar_batches(stream, steps, 8, 128)
    base = quality.initial_model(qargs, "cpu").float()
    if args.part == "step":
        one_step(base, data[0])
        return 0
    arms = {"plain fp32": (plain, False), "slid fp32": (slid, False), "plain FP8": (plain, True),
            "slid FP8": (slid, True)}
    results = {name: train(qargs, *make(base, fp8), data, blocks, name) for name, (make, fp8) in arms.items()}
    if args.part == "fall":
        results["plain bf16 ac"] = train(qargs, *plain(base, False), data, blocks, "bf16 ac", autocast=True)
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            print("torchao not installed: its arm left out")
        else:
            model = copy.deepcopy(base)
            convert_to_float8_training(model.model.layers, config=Float8LinearConfig.from_recipe_name("rowwise"))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
            results["torchao ac"] = train(qargs, model, opt, data, blocks, "torchao", autocast=True)
    print(f"train loss, the mean over each {every} step(s):")
    for name, losses in results.items():
        print(f"{name:14s}", " ".join(f"{x:.4f}" for x in losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
