"""Fine-tune a causal LM with the Hugging Face Trainer on a sliding model.

    python examples/train_trainer.py --output_dir out --max_steps 50 --per_device_train_batch_size 4 \\
        --gradient_accumulation_steps 2 --bf16 --slide_window 2 --slide_gpu_memory_limit 24 [--model_dir DIR]

Every TrainingArguments flag works, plus the `--slide_*` flags of SlideArgs (docs/options.md);
`--resume_from_checkpoint out/checkpoint-20` (or `true`: the last checkpoint in --output_dir)
continues a run exactly where that checkpoint left it.
Without --model_dir it trains a random-init Llama of the shape --shape (tiny by default) on the
bundled corpus, bytes as tokens (or random tokens for large vocabularies). It prints one JSON line
at the end: the logged losses (one per --logging_steps; none in a run shorter than that), the
mean training loss, tokens/s, peak GPU memory.
"""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

import hf_slideformer as hs

CORPUS = Path(hs.__file__).parent / "data" / "corpus.txt"
SHAPES = {  # random-init Llama shapes: (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (64, 128, 2, 4, 2, 256),
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),
    "llama-3b": (3072, 8192, 28, 24, 8, 128256),
}


@dataclass
class DataArgs:
    """What to train: a local checkpoint or a random-init shape, and the data size."""

    model_dir: Optional[str] = field(default=None, metadata={"help": "Local HF checkpoint (default: random init)."})
    shape: str = field(default="tiny", metadata={"help": f"Random-init Llama shape: {sorted(SHAPES)}."})
    seq_len: int = field(default=64, metadata={"help": "Tokens per sample."})
    samples: int = field(default=128, metadata={"help": "Training samples."})


def dataset(seq_len: int, samples: int, vocab: int) -> list[dict]:
    if vocab >= 256:
        data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
        n = min(len(data) // seq_len, samples)
        if n == samples:
            return [{"input_ids": b, "labels": b.clone()} for b in data[: n * seq_len].view(n, seq_len)]
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (x := torch.randint(0, vocab, (seq_len,), generator=g)), "labels": x.clone()}
            for _ in range(samples)]


def main():
    args, data = HfArgumentParser((hs.SlideArgs, DataArgs)).parse_args_into_dataclasses()
    if data.model_dir:
        model = hs.SlideModel.from_pretrained(data.model_dir, slide_config=args.to_slide_config())
    else:
        h, i, n, a, kv, v = SHAPES[data.shape]
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                                             num_attention_heads=a, num_key_value_heads=kv, vocab_size=v,
                                             max_position_embeddings=max(data.seq_len, 128)))
    train = dataset(data.seq_len, data.samples, model.config.vocab_size)
    trainer = hs.SlideTrainer(model=model, args=args, train_dataset=train, eval_dataset=train[:8])
    resume = args.resume_from_checkpoint
    if resume is not None and resume.lower() == "true":
        resume = True                                   # the Trainer's own: the last checkpoint in output_dir
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    if args.output_dir and args.should_save:
        trainer.save_model(args.output_dir)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else 0.0
    print(json.dumps({"losses": [h["loss"] for h in logs], "grad_norms": [h.get("grad_norm") for h in logs],
                      "tokens_per_s": [h.get("tokens_per_s") for h in logs], "train_loss": result.training_loss,
                      "eval_loss": metrics["eval_loss"], "global_step": result.global_step,
                      "train_runtime": result.metrics["train_runtime"], "peak_gpu_GiB": peak,
                      "breakdown": {k: v for k, v in (logs[-1] if logs else {}).items() if k.startswith("slide/")},
                      "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
