"""Fine-tune a tiny Llama-shaped model on the bundled corpus with hf_slideformer.

The default job of the project (`bash scripts/train.sh`): no downloads, about 15 s on 2 CPU cores,
and on the GPU when one is present. It trains on nine blocks in ten, measures the loss on the tenth
before and after, prints the model's greedy continuation of a prompt, and ends with one line that
says whether training worked (exit status 1 when the held-out loss did not fall).

    python examples/finetune_tiny.py [--steps 200] [--device cpu] [--save DIR]

Under `torchrun --nproc_per_node N examples/finetune_tiny.py` the N processes train the one model
together (data parallel, docs/multi_gpu.md): each takes its 1/N of every step's batch (--batch is
the global batch), and rank 0 prints and saves.
"""
from __future__ import annotations

import argparse
import sys
import time

PROMPT = "The lighthouse keeper"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (parsed before torch is imported, so that --help answers at once)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    ap.add_argument("--block", type=int, default=64, help="tokens per sequence (default: 64)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--model-type", default="llama", help="llama, qwen2, qwen3 or mistral (default: llama)")
    ap.add_argument("--log-every", type=int, default=25, help="print the loss every N steps (default: 25)")
    ap.add_argument("--save", default=None, help="directory to save the fine-tuned model and tokenizer to")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit status (0 when the held-out loss fell)."""
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    import hf_slideformer as hs
    from hf_slideformer.demo import tiny_config, token_blocks, train_tokenizer

    if args.model_type not in hs.SUPPORTED_MODEL_TYPES:
        sys.exit(f"--model-type {args.model_type!r} is not one of {list(hs.SUPPORTED_MODEL_TYPES)}")
    torch.manual_seed(0)
    tok = train_tokenizer()
    blocks = token_blocks(tok, args.block)                      # (N, block) token ids
    is_held_out = torch.arange(len(blocks)) % 10 == 9
    train, held_out = blocks[~is_held_out], blocks[is_held_out]
    model = AutoModelForCausalLM.from_config(tiny_config(args.model_type, vocab_size=len(tok)))
    cfg = hs.SlideConfig(device=args.device, max_grad_norm=1.0)
    model = hs.slide(model, cfg)
    dp = model.slide_engine.dp                                  # several processes (torchrun), or None
    rank, world = (dp.rank, dp.world) if dp is not None else (0, 1)
    if args.batch % world:
        sys.exit(f"--batch {args.batch} does not split over {world} processes")
    mine = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    say = print if rank == 0 else (lambda *a, **k: None)        # rank 0 speaks
    opt = model.create_optimizer(lr=args.lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=min(10, args.steps // 10),
                                            num_training_steps=args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {args.model_type}, {n_params / 1e6:.2f}M parameters; data: {len(train)} training blocks of "
          f"{args.block} tokens, {len(held_out)} held out; device {model.slide_config.device}, dtype {cfg.dtype}"
          + (f"; {world} processes" if world > 1 else ""), flush=True)

    @torch.no_grad()
    def held_out_loss() -> float:
        model.eval()
        loss = sum(model(input_ids=b, labels=b).loss.item() for b in held_out.split(32)) / len(held_out.split(32))
        model.train()
        return loss

    before = held_out_loss()
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    first = last = float("nan")
    for step in range(args.steps):
        batch = train[torch.randint(0, len(train), (args.batch,), generator=g)][mine]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        last = loss.item()
        first = last if step == 0 else first
        if step % args.log_every == 0 or step == args.steps - 1:
            say(f"step {step:4d}  loss {last:.3f}  grad_norm {opt.last_grad_norm:.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:.1f}s", flush=True)
    elapsed = time.time() - t0
    after = held_out_loss()

    prompt = tok(PROMPT, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0], skip_special_tokens=True)
    say(f"greedy continuation: {text[: text.find('.') + 1] or text!r}")      # up to the first full stop
    say(f"held-out loss: {before:.3f} before training, {after:.3f} after")
    if args.save:
        model.save_pretrained(args.save)                         # with several processes rank 0 writes
        if rank == 0:
            tok.save_pretrained(args.save)
        say(f"saved to {args.save} (loads with transformers.AutoModelForCausalLM)")
    if not after < before:
        say(f"FAILED: the held-out loss did not fall in {args.steps} steps ({before:.3f} -> {after:.3f})")
        return 1
    say(f"OK: fine-tuned in {elapsed:.1f} s on {model.slide_config.device}; training loss {first:.2f} -> {last:.2f}, "
          f"held-out loss {before:.2f} -> {after:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
