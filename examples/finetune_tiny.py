"""Fine-tune a tiny Llama-shaped model on the bundled corpus with hf_slideformer.

The default job of the project: no downloads, runs in well under a minute on 2 CPU cores, and on
the GPU when one is present. Usage: python examples/finetune_tiny.py [--steps 60] [--device cpu]
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from hf_slideformer.demo import tiny_config, token_blocks, train_tokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--model-type", default="llama", choices=list(hs.SUPPORTED_MODEL_TYPES))
    ap.add_argument("--save", default=None, help="directory to save the fine-tuned model to")
    args = ap.parse_args()

    torch.manual_seed(0)
    tok = train_tokenizer()
    data = token_blocks(tok, args.block)
    model = AutoModelForCausalLM.from_config(tiny_config(args.model_type, vocab_size=len(tok)))
    cfg = hs.SlideConfig(device=args.device, gradient_accumulation_steps=1, max_grad_norm=1.0)
    model = hs.slide(model, cfg)
    opt = model.create_optimizer(lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model_type}, {n_params / 1e6:.2f}M parameters, {len(data)} blocks of {args.block} tokens; "
          f"device {cfg.device}, dtype {cfg.dtype}")
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        idx = torch.randint(0, len(data), (args.batch,), generator=g)
        batch = data[idx]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  grad_norm {opt.last_grad_norm:.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:.1f}s")
    prompt = tok("The lighthouse keeper", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0], skip_special_tokens=True)
    print(f"done in {time.time() - t0:.1f}s; greedy continuation: {text!r}")
    if args.save:
        model.save_pretrained(args.save)
        tok.save_pretrained(args.save)
        print(f"saved to {args.save}")


if __name__ == "__main__":
    main()
