"""Checkpoints that store a mixture of experts one tensor per expert.

HF's MoE modules hold each layer's experts fused in 3-D parameters (`mlp.experts.gate_up_proj`:
(E, 2I, H), `mlp.experts.down_proj`: (E, H, I)), while the released Qwen3-MoE, Qwen3.5-MoE and
Mixtral checkpoints, and HF's own `save_pretrained` of them, store one 2-D tensor per expert
(`mlp.experts.<j>.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.<j>.w1.weight`). HF's
loader converts with its conversion mapping (`transformers.conversion_mapping`: the per-expert
tensors stacked over the experts, gate and up concatenated along the output features, Mixtral's
`block_sparse_moe` read as `mlp`); `load_weights` (checkpoint.py) does the same here for a fused
name the checkpoint lacks, a layer's experts at a time, whichever shards they lie in.
"""
from __future__ import annotations

import contextlib
import os

import torch
from safetensors import safe_open

__all__ = ["renamed_source", "per_expert_sources", "read_stacked"]

# fused leaf -> the per-expert leaves concatenated (in order, along the output features) to form
# each expert's slice, in each naming the checkpoints use (HF's, Mixtral's w1 / w3 / w2)
_PER_EXPERT = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}
# the model's name -> the checkpoint's (Mixtral's sparse MoE block)
_RENAMES = ((".mlp.", ".block_sparse_moe."),)


def _spellings(name: str) -> list[str]:
    return [name] + [name.replace(ours, theirs) for ours, theirs in _RENAMES if ours in name]


def renamed_source(name: str, weight_map: dict[str, str]) -> str | None:
    """The checkpoint's name of the model's tensor `name` under another spelling of its module
    (Mixtral's `block_sparse_moe.gate.weight` for `mlp.gate.weight`), or None."""
    return next((n for n in _spellings(name)[1:] if n in weight_map), None)


def per_expert_sources(name: str, weight_map: dict[str, str]) -> list[list[str]] | None:
    """For the fused expert weight `name`: per expert (in order), the checkpoint's tensors whose
    concatenation along dim 0 is that expert's slice; None where the checkpoint does not hold it
    one tensor per expert."""
    prefix, _, leaf = name.rpartition(".")
    if leaf not in _PER_EXPERT or not prefix.endswith(".experts"):
        return None
    for spelled in _spellings(prefix):
        for parts in _PER_EXPERT[leaf]:
            count = 0
            while all(f"{spelled}.{count}.{part}.weight" in weight_map for part in parts):
                count += 1
            if count:
                return [[f"{spelled}.{j}.{part}.weight" for part in parts] for j in range(count)]
    return None


def read_stacked(path: str, weight_map: dict[str, str], sources: list[list[str]]) -> torch.Tensor:
    """The fused (E, out, in) tensor of `sources` (`per_expert_sources`), read from the shards of
    the checkpoint at `path` that hold them."""
    with contextlib.ExitStack() as stack:
        files = {}

        def read(name: str) -> torch.Tensor:
            fname = weight_map[name]
            if fname not in files:
                files[fname] = stack.enter_context(safe_open(os.path.join(path, fname), "pt"))
            return files[fname].get_tensor(name)

        return torch.stack([torch.cat([read(n) for n in group], dim=0) for group in sources])
