"""Checkpoints in HF's format: reading safetensors straight into the host store, and writing
the masters back out as sharded safetensors, unit by unit, in the training dtype."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from .models import get_adapter

__all__ = ["load_model_meta", "load_weights", "save_model", "CheckpointError"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has mismatched shapes, or cannot be read."""


def load_model_meta(path, **config_overrides):
    """Build the HF model of the checkpoint at `path` on the meta device (no memory)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory with config.json and *.safetensors "
                              "(hub names cannot be downloaded here: pass a local directory)")
    config = AutoConfig.from_pretrained(path, **config_overrides)
    get_adapter(getattr(config, "model_type", None))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model


def _index(path) -> dict[str, str]:
    """tensor name -> file name."""
    idx = os.path.join(path, INDEX_NAME)
    if os.path.exists(idx):
        with open(idx) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.exists(single):
        with safe_open(single, "pt") as f:
            return {k: WEIGHTS_NAME for k in f.keys()}
    raise CheckpointError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path} (only safetensors checkpoints are read)")


def load_weights(model, path) -> None:
    """Read every tensor of the checkpoint at `path` into the slid model's masters, one at a time."""
    store = model.slide_engine.store
    weight_map = _index(path)
    expected = {}
    for u in store.units:
        for e in u.entries:
            expected[e.name] = (u, e)
    aliases = {}
    tied = model.slide_engine.tied
    missing = [n for n in expected if n not in weight_map]
    if tied:
        for n in list(missing):
            alt = "lm_head.weight"
            if n.endswith("embed_tokens.weight") and alt in weight_map:
                aliases[n] = alt
                missing.remove(n)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s): {', '.join(missing[:20])}"
                              f"{' ...' if len(missing) > 20 else ''}")
    by_file: dict[str, list[str]] = {}
    for n in expected:
        src = aliases.get(n, n)
        by_file.setdefault(weight_map[src], []).append(n)
    mismatched = []
    bar = tqdm(total=sum(u.numel for u in store.units) * 4, unit="B", unit_scale=True, desc="loading weights",
               disable=sum(u.numel for u in store.units) < 50_000_000)
    with torch.no_grad():
        for fname, names in by_file.items():
            fpath = os.path.join(path, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"checkpoint file {fpath} named in the index does not exist")
            with safe_open(fpath, "pt") as f:
                for n in names:
                    u, e = expected[n]
                    t = f.get_tensor(aliases.get(n, n))
                    if tuple(t.shape) != tuple(e.shape):
                        mismatched.append(f"{n}: checkpoint {tuple(t.shape)} vs model {tuple(e.shape)}")
                        continue
                    e.view(u.master).copy_(t)
                    bar.update(e.numel * 4)
    bar.close()
    if mismatched:
        raise CheckpointError(f"checkpoint {path} has tensors of the wrong shape: {'; '.join(mismatched[:20])}")
    unexpected = set(weight_map) - {aliases.get(n, n) for n in expected}
    unexpected = {n for n in unexpected if not (tied and n == "lm_head.weight")}
    if unexpected:
        import logging
        logging.getLogger(__name__).warning("checkpoint tensors not used by the model: %s", sorted(unexpected)[:20])


def _parse_size(s) -> int:
    if isinstance(s, int):
        return s
    s = s.strip().upper()
    for suf, mul in (("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3), ("GIB", 2 ** 30), ("MIB", 2 ** 20)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * mul)
    return int(s)


def save_model(model, save_directory, max_shard_size="5GB", dtype=torch.bfloat16) -> None:
    """Write the masters of a slid model as HF sharded safetensors + config (+ generation config).

    Files are first written into a temporary directory beside `save_directory` and moved in
    at the end, so an interrupted save never leaves a half-written checkpoint behind.
    """
    eng = model.slide_engine
    limit = _parse_size(max_shard_size)
    os.makedirs(save_directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".slide-save-", dir=save_directory)
    try:
        size = 0
        plan: list[list[tuple[str, object, object]]] = [[]]
        for u in eng.store.units:
            for e in u.entries:
                nbytes = e.numel * torch.finfo(dtype).bits // 8
                if plan[-1] and size + nbytes > limit:
                    plan.append([])
                    size = 0
                plan[-1].append((e.name, u, e))
                size += nbytes
        n = len(plan)
        weight_map, total = {}, 0
        for k, items in enumerate(plan):
            fname = WEIGHTS_NAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            tensors = {name: e.view(u.master).to(dtype).contiguous() for name, u, e in items}
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
            for name in tensors:
                weight_map[name] = fname
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        if n > 1:
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        cfg = model.config
        cfg.architectures = [model._slide_base_class.__name__]
        old_dtype = getattr(cfg, "dtype", None)
        cfg.dtype = dtype
        cfg.save_pretrained(tmp)
        cfg.dtype = old_dtype
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            try:
                gen.save_pretrained(tmp)
            except Exception:  # noqa: BLE001 - a generation config is optional
                pass
        for old in os.listdir(save_directory):
            if old.endswith(".safetensors") or old == INDEX_NAME:
                if not old.startswith(".slide-save-"):
                    os.remove(os.path.join(save_directory, old))
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(save_directory, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
