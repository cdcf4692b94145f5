"""FP8 quality: one Llama-shaped model trained in bf16 and with its projections in FP8, same seed
and data, its train loss and a held-out loss side by side.

    python3 benchmarks/fp8_quality.py --steps 500 --json fp8_quality.json
    python3 benchmarks/fp8_quality_plot.py fp8_quality.json docs/fp8_quality.svg     # the figure

The split (`corpus_split`): the bundled corpus (hf_slideformer/data/corpus.txt) is 120
paragraphs; paragraph i is held out when i % 10 == 9 (12 paragraphs, 841 of its 8,246 tokens
with the corpus's own BPE tokenizer, which has 695 tokens), the rest is the train split. Each
split is one token stream, <eos> after each paragraph. Training draws `--steps` batches of
`--batch` windows of `--seq` tokens from the train stream with one seeded generator (the same
batches, in the same order, for both arms); the held-out loss is the mean loss over the held-out
stream cut into whole `--seq`-token blocks (the tail shorter than a block left out), taken with
the arm's own forward under `torch.no_grad()` at step 0 and at every logged step.

The model (default 0.76 B parameters: hidden 2048, 12 layers, 16 heads, 8 kv heads, intermediate
8192, vocab 1024, the tokenizer's 695 tokens padded; docs/benchmarks.md says why) starts from the same random weights in both
arms, trains with AdamW and a linear warm-up, slid on the GPU (`hs.slide`), the second arm with
`SlideConfig(matmuls="fp8")` (docs/fp8.md). At each logged step the train loss is the mean of
the steps since the last log (as the Trainer logs it).

The criterion (`judge`), after `--warmup` steps: the FP8 held-out loss within `--tolerance`
(1.5%) of bf16's at every logged step up to bf16's lowest held-out loss, the FP8 train loss
within it where both arms' train loss is above the floor (the lowest held-out loss either arm
reached), and FP8's losses nowhere more than the tolerance above bf16's over the whole run.
Below the floor the train loss measures memorization (the model predicts the training windows
better than it predicts any unseen paragraph of the same corpus) and falls toward 0; past its
lowest point the held-out loss rises because the model memorizes, and how fast follows each
arm's own path: there the gap is reported, and only FP8 above bf16 counts against it.

`--max-seconds` bounds the whole run from the start: the bf16 arm stops once half of it has
passed, and the FP8 arm runs the steps the bf16 arm made (both curves cover the same steps; the
output says when they are fewer than `--steps`). `--emulate` runs the FP8 arm through the
recipe's CPU emulation instead (a smoke test on a machine without FP8 tensor cores).
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
from hf_slideformer.demo import corpus_path, train_tokenizer  # noqa: E402

HELD_OUT_EVERY = 10      # paragraph i is held out when i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def corpus_split(tokenizer, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's (train, held-out) token streams: paragraph i held out when i % 10 == 9."""
    with open(path or corpus_path(), encoding="utf-8") as f:
        paras = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    train: list[int] = []
    held: list[int] = []
    for i, para in enumerate(paras):
        ids = tokenizer(para)["input_ids"] + [tokenizer.eos_token_id]
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(ids)
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


def train_batches(stream: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """`steps` (batch, seq) windows of `stream` at seeded random starts: the same for both arms."""
    if stream.numel() <= seq:
        raise ValueError(f"the train split has {stream.numel()} tokens: --seq {seq} needs more")
    gen = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, stream.numel() - seq, (steps, batch), generator=gen)
    return [torch.stack([stream[s:s + seq] for s in row.tolist()]) for row in starts]


def held_out_blocks(stream: torch.Tensor, seq: int) -> torch.Tensor:
    """The held-out stream as (n, seq) whole blocks, the shorter tail left out."""
    n = stream.numel() // seq
    if n == 0:
        raise ValueError(f"the held-out split has {stream.numel()} tokens: --seq {seq} needs fewer")
    return stream[:n * seq].view(n, seq)


def model_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                       vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False,
                       use_cache=False)


def initial_model(args, device: str):
    """Random weights (normal(0, 0.02), norms 1), made on `device` from `--seed`, returned on the CPU."""
    from benchmarks.providers.base import build_model
    return build_model(model_config(args), device, torch.bfloat16, fill="normal", seed=args.seed).cpu()


def held_out_loss(model, blocks: torch.Tensor, device: str) -> float:
    """The mean loss over the held-out blocks (equal lengths: the mean of the blocks' losses)."""
    with torch.no_grad():
        losses = [model(input_ids=b[None].to(device), labels=b[None].to(device)).loss.float() for b in blocks]
    return torch.stack(losses).mean().item()


def train_arm(args, matmuls: str, data: list[torch.Tensor], blocks: torch.Tensor, device: str,
              deadline: float = float("inf")) -> dict:
    """Train on `data` in order, stopping after the step that ends past `deadline` (perf_counter):
    every step's train loss, and the held-out loss at step 0 and every `--log-every` steps."""
    model = initial_model(args, device)
    emulate = matmuls == "fp8" and args.emulate
    model = hs.slide(model, hs.SlideConfig(device=device, dtype=torch.bfloat16, matmuls="dtype" if emulate else matmuls))
    if emulate:
        from hf_slideformer.compute.layer_matmuls import install_emulation
        install_emulation(model)
    opt = model.create_optimizer(lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    train, held = [], {0: held_out_loss(model, blocks, device)}
    t0 = time.perf_counter()
    for n, ids in enumerate(data, start=1):
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        train.append(loss.item())
        if n % args.log_every == 0:
            held[n] = held_out_loss(model, blocks, device)
            print(f"  {matmuls:5s} step {n:4d}  train {sum(train[-args.log_every:]) / args.log_every:.4f}  "
                  f"held-out {held[n]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if time.perf_counter() > deadline:
            print(f"  {matmuls:5s} stopped after step {n}: its share of --max-seconds reached", flush=True)
            break
    model.slide_engine.close()
    del model, opt
    gc.collect()
    return {"train": train, "held_out": held, "seconds": time.perf_counter() - t0}


def logged_rows(arms: dict[str, dict], log_every: int) -> list[dict]:
    """One row per logged step both arms reached: the step, each arm's mean train loss since the
    last log (None at step 0) and its held-out loss."""
    steps = sorted(set(arms["bf16"]["held_out"]) & set(arms["fp8"]["held_out"]))
    rows = []
    for step in steps:
        row = {"step": step}
        for name, arm in arms.items():
            window = arm["train"][max(0, step - log_every):step]
            row[f"{name}_train"] = sum(window) / len(window) if window else None
            row[f"{name}_held_out"] = arm["held_out"][step]
        rows.append(row)
    return rows


def rel_gap(a: float, b: float) -> float:
    """|b - a| / |a|: FP8's (b) distance from bf16's (a)."""
    return abs(b - a) / abs(a)


def judge(rows: list[dict], warmup: int, tolerance: float) -> dict:
    """The criterion on the logged rows after `warmup`, over the learning phase: FP8's held-out loss
    within `tolerance` of bf16's at every logged step up to bf16's lowest held-out loss (past it
    the held-out loss rises as the model memorizes), and its train loss within it wherever both
    train losses are above the floor (the lowest held-out loss of either arm). Over the whole run
    after `warmup`, FP8's loss (held-out, and train above the floor) nowhere more than `tolerance`
    above bf16's (`fp8_not_worse`: lower is no loss of quality). `met`: both hold."""
    floor = min(min(r["bf16_held_out"], r["fp8_held_out"]) for r in rows)
    best = min(rows, key=lambda r: r["bf16_held_out"])["step"]
    after = [r for r in rows if r["step"] > warmup]
    learning = [r for r in after if r["step"] <= best]
    above = [r for r in after if r["bf16_train"] is not None and min(r["bf16_train"], r["fp8_train"]) > floor]
    held = max(((rel_gap(r["bf16_held_out"], r["fp8_held_out"]), r["step"]) for r in learning), default=(0.0, 0))
    train = max(((rel_gap(r["bf16_train"], r["fp8_train"]), r["step"]) for r in above), default=(0.0, 0))
    late = max(((rel_gap(r["bf16_held_out"], r["fp8_held_out"]), r["step"]) for r in after if r["step"] > best),
               default=(0.0, 0))
    excess = max(((r[f"fp8_{kind}"] - r[f"bf16_{kind}"]) / r[f"bf16_{kind}"] for kind, rs in
                  (("held_out", after), ("train", above)) for r in rs), default=0.0)
    not_worse = bool(after) and excess <= tolerance
    return {"floor": floor, "best_step": best, "tolerance": tolerance,
            "held_out_max_gap": held[0], "held_out_max_step": held[1],
            "held_out_steps_judged": [r["step"] for r in learning],
            "train_max_gap": train[0], "train_max_step": train[1], "train_steps_judged": [r["step"] for r in above],
            "memorizing_max_gap": late[0], "memorizing_max_step": late[1],
            "fp8_max_excess": excess, "fp8_not_worse": not_worse,
            "met": bool(learning) and held[0] <= tolerance and train[0] <= tolerance and not_worse}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=1024, help="at least the tokenizer's 695 tokens")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (linear lr), not judged")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=0.015, help="the largest relative gap the criterion allows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--emulate", action="store_true", help="the FP8 arm through the CPU emulation (smoke test)")
    p.add_argument("--max-seconds", type=float, default=200,
                   help="the whole run's time from the start: the bf16 arm stops at half, the FP8 arm makes as many steps")
    p.add_argument("--json", required=True, help="where to write the results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    tokenizer = train_tokenizer(vocab_size=4096)          # the corpus's BPE saturates at 695 tokens
    if len(tokenizer) > args.vocab:
        raise SystemExit(f"--vocab {args.vocab} is below the tokenizer's {len(tokenizer)} tokens")
    train_stream, held_stream = corpus_split(tokenizer)
    data = train_batches(train_stream, args.steps, args.batch, args.seq, args.seed)
    blocks = held_out_blocks(held_stream, args.seq)
    print(f"split: {train_stream.numel()} train tokens, {held_stream.numel()} held out ({blocks.shape[0]} blocks "
          f"of {args.seq}); {args.steps} steps of {args.batch} x {args.seq}", flush=True)
    arms = {}
    for name, matmuls in (("bf16", "dtype"), ("fp8", "fp8")):
        deadline = start + args.max_seconds / 2 if name == "bf16" else float("inf")
        arms[name] = train_arm(args, matmuls, data, blocks, args.device, deadline)
        data = data[:len(arms[name]["train"])]        # the FP8 arm covers the steps the bf16 arm made
    rows = logged_rows(arms, args.log_every)
    verdict = judge(rows, args.warmup, args.tolerance)
    print_table(rows, verdict, len(data), args)
    doc = {"args": vars(args), "steps_run": len(data), "rows": rows, "verdict": verdict,
           "split": {"held_out_every": HELD_OUT_EVERY, "train_tokens": train_stream.numel(),
                     "held_out_tokens": held_stream.numel(), "held_out_blocks": blocks.shape[0],
                     "tokenizer_tokens": len(tokenizer)},
           "bf16": arms["bf16"], "fp8": arms["fp8"], "seconds": time.perf_counter() - start,
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "fp8_emulated": args.emulate}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


def print_table(rows: list[dict], verdict: dict, steps: int, args) -> None:
    """The logged rows (train and held-out per arm, their gaps) and the verdict, last."""
    if steps < args.steps:
        print(f"both arms ran {steps} of {args.steps} steps (--max-seconds {args.max_seconds:.0f})")
    print(f"\n{'step':>5} {'bf16 train':>10} {'fp8 train':>10} {'gap':>7} {'bf16 held':>10} {'fp8 held':>10} {'gap':>7}")
    for r in rows:
        train = ("", "", "") if r["bf16_train"] is None else (
            f"{r['bf16_train']:.4f}", f"{r['fp8_train']:.4f}", f"{rel_gap(r['bf16_train'], r['fp8_train']):.2%}")
        print(f"{r['step']:5d} {train[0]:>10} {train[1]:>10} {train[2]:>7} {r['bf16_held_out']:10.4f} "
              f"{r['fp8_held_out']:10.4f} {rel_gap(r['bf16_held_out'], r['fp8_held_out']):7.2%}")
    print(f"held-out, steps {args.warmup + 1}-{verdict['best_step']} (to bf16's lowest): max gap "
          f"{verdict['held_out_max_gap']:.2%} (step {verdict['held_out_max_step']}); past it, memorizing: max gap "
          f"{verdict['memorizing_max_gap']:.2%} (step {verdict['memorizing_max_step']})")
    print(f"train above the floor {verdict['floor']:.4f} (the lowest held-out loss): max gap "
          f"{verdict['train_max_gap']:.2%} (step {verdict['train_max_step']}, {len(verdict['train_steps_judged'])} "
          f"logged steps judged)")
    print(f"FP8 at most {verdict['fp8_max_excess']:+.2%} above bf16 at the judged steps: "
          f"{'not worse' if verdict['fp8_not_worse'] else 'WORSE'} (within {verdict['tolerance']:.1%} one way)")
    print(f"criterion (every gap within {verdict['tolerance']:.1%}): {'met' if verdict['met'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
