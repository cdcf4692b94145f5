"""The embedded default job: a tiny model, a tokenizer trained locally on the bundled corpus,
and the data pipeline that feeds them. Nothing is downloaded.
"""
from __future__ import annotations

import os

import torch

__all__ = ["corpus_path", "train_tokenizer", "tiny_config", "token_blocks"]


def corpus_path() -> str:
    """Path of the small English corpus shipped with the package."""
    return os.path.join(os.path.dirname(__file__), "data", "corpus.txt")


def train_tokenizer(vocab_size: int = 384, path: str | None = None):
    """A byte-level BPE tokenizer trained on the bundled corpus (about a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([path or corpus_path()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_config(model_type: str = "llama", vocab_size: int = 384, **overrides):
    """A tiny config of a supported family (random init; a few hundred thousand parameters)."""
    from transformers import AutoConfig

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=None, eos_token_id=1, tie_word_embeddings=False)
    if model_type == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def token_blocks(tokenizer, block: int = 64, path: str | None = None) -> torch.Tensor:
    """The corpus tokenized, with <eos> between paragraphs, cut into (N, block) blocks."""
    with open(path or corpus_path(), encoding="utf-8") as handle:
        paras = [p.strip() for p in handle.read().split("\n\n") if p.strip()]
    ids: list[int] = []
    for para in paras:
        ids.extend(tokenizer(para)["input_ids"] + [tokenizer.eos_token_id])
    num_blocks = len(ids) // block
    return torch.tensor(ids[: num_blocks * block], dtype=torch.long).view(num_blocks, block)
