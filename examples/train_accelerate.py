"""Fine-tune a causal LM with a plain Accelerate loop on a sliding model.

    accelerate launch --config_file examples/slideformer.yaml examples/train_accelerate.py [--model_dir DIR]

The slide settings (window, activation tier, CPU threads, accumulation, clipping, ...) come from
the `slideformer:` mapping of the yaml; the loop below is an ordinary Accelerate loop. Without
--model_dir it trains a tiny random-init Llama on the bundled corpus (bytes as tokens), which is
what the tests run. It prints one JSON line at the end (losses, threads, timings).
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, get_scheduler

import hf_slideformer as hs
from hf_slideformer.accelerate_plugin import SlideAccelerator, worker_threads

CORPUS = Path(hs.__file__).parent / "data" / "corpus.txt"


def byte_blocks(seq_len: int, limit: int) -> list[dict]:
    """The bundled corpus as (seq_len,) blocks of byte ids (vocabulary 256)."""
    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    n = min(len(data) // seq_len, limit)
    blocks = data[: n * seq_len].view(n, seq_len)
    return [{"input_ids": b, "labels": b.clone()} for b in blocks]


def tiny_llama(hidden: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default=None, help="local HF checkpoint (default: a tiny random Llama)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--output_dir", default=None, help="save the fine-tuned model here (HF safetensors)")
    args = p.parse_args()

    accelerator = SlideAccelerator()                    # slide settings: the launch yaml's `slideformer:`
    if args.model_dir:
        model = hs.SlideModel.from_pretrained(args.model_dir, slide_config=accelerator.slide_config())
    else:
        model = accelerator.slide(tiny_llama(args.hidden, args.layers))
    optimizer = model.create_optimizer(lr=args.lr, weight_decay=args.weight_decay)
    loader = DataLoader(byte_blocks(args.seq_len, args.samples), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    steps = args.epochs * math.ceil(len(loader) / accelerator.gradient_accumulation_steps)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=max(steps // 10, 1), num_training_steps=steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, t0, tokens = [], time.perf_counter(), 0
    model.train()
    for _ in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and model.slide_config.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), model.slide_config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            tokens += batch["input_ids"].numel()
            losses.append(loss.item())
    elapsed = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        eval_loss = sum(model(**b).loss.item() for b in loader) / len(loader)
    if args.output_dir:
        accelerator.unwrap_model(model).save_pretrained(args.output_dir)   # several processes: the main one writes
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            AutoModelForCausalLM.from_pretrained(args.output_dir)     # the export loads in plain HF
    accelerator.print(json.dumps({
        "losses": losses, "eval_loss": eval_loss, "optimizer_steps": model.slide_stats()["steps"],
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "max_grad_norm": model.slide_config.max_grad_norm, "dtype": str(model.slide_config.dtype),
        "tokens_per_s": tokens / elapsed, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "main_threads": torch.get_num_threads(), "cpu_optimizer_threads": worker_threads(model)}))


if __name__ == "__main__":
    main()
