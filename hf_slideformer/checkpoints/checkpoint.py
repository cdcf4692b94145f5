"""Checkpoints in HF's format: reading safetensors straight into the host store, and writing
the masters back out as sharded safetensors, unit by unit (fp32 by default, as HF saves).

An MXFP4 checkpoint (gpt-oss's release: `quantization_config.quant_method == "mxfp4"`, each
expert weight `W` stored as `W_blocks` and `W_scales`) is read dequantized: the masters start
from the exact values the 4-bit codes and their power-of-two scales stand for (HF's own
`convert_moe_packed_tensors`, in fp32, where they are exact), the model is built and saved
without the quantization config, so a save is a plain checkpoint HF loads as it loads any other.

Note: [How save_model replaces an earlier save] a directory can hold other things (a tokenizer,
the Trainer's `checkpoint-N` folders), so the save is committed file by file, in place, in an
order where every intermediate state loads as the old save or the new one:

1. every new file is written and fsynced in a hidden staging folder (`.slide-save-*`);
2. new shards move in under names the current save does not reference (its shards keep
   `model-XXXXX-of-YYYYY`; the new ones take `model-b-XXXXX-of-YYYYY` when those are taken);
3. the weights switch with one rename: `model.safetensors`, or `model.safetensors.index.json`
   followed by removing an old `model.safetensors` (loaders read `model.safetensors` first);
4. `config.json` moves in before the weights if the new save's dtype is at least as wide as
   the old one's, else after: in between, the values loaded are exactly the old or the new ones;
5. files the new save does not reference, and staging folders of killed saves, are removed.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging as hf_logging
from transformers import AutoConfig, AutoModelForCausalLM

from .expert_layout import per_expert_sources, read_stacked, renamed_source
from .atomic_save import fsync_dir, fsync_file, leftover_path, one_save_at_a_time, remove_leftovers
from ..models import get_adapter
from ..engine.slide_checks import check_finite

__all__ = ["load_model_meta", "load_weights", "save_model", "CheckpointError"]

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
STAGING = "slide-save"
MXFP4 = "mxfp4"
_PACKED = ("_blocks", "_scales")
_SHARD = re.compile(r"^model(-b)?-\d{5}-of-\d{5}\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has mismatched shapes, or cannot be read."""


def load_model_meta(path, **config_overrides):
    """Build the HF model of the checkpoint at `path` on the meta device (no memory)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory with config.json and *.safetensors "
                              "(hub names cannot be downloaded here: pass a local directory)")
    config = AutoConfig.from_pretrained(path, **config_overrides)
    get_adapter(getattr(config, "model_type", None))
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if str(method).lower() != MXFP4:
            raise CheckpointError(
                f"checkpoint {path} is quantized ({method}); hf_slideformer trains full-precision weights and "
                f"reads {MXFP4} checkpoints dequantized only: save a dequantized copy with HF first")
        del config.quantization_config        # the masters are full precision, and so is every save
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _load_buffers(model, path)
    return model


def persistent_buffers(model) -> dict[str, torch.Tensor]:
    """The buffers HF saves beside the weights (Gemma 4's layer scalars), by their names: the
    store holds parameters only, so a save writes these and a load reads them in place."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _load_buffers(model, path) -> None:
    """Materialize the persistent buffers of the meta model from the checkpoint (small tensors)."""
    wanted = persistent_buffers(model)
    if not wanted:
        return
    weight_map = _index(path)
    for name in wanted:
        if name not in weight_map:
            continue                 # left as the model's init builds it (HF does the same)
        with safe_open(os.path.join(path, weight_map[name]), "pt") as handle:
            tensor = handle.get_tensor(name)
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix)
        module._buffers[leaf] = tensor.to(wanted[name].dtype)


def _index(path) -> dict[str, str]:
    """tensor name -> file name; `model.safetensors` wins over an index, as in HF's loader."""
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.exists(single):
        with safe_open(single, "pt") as handle:
            return {k: WEIGHTS_NAME for k in handle.keys()}
    idx = os.path.join(path, INDEX_NAME)
    if os.path.exists(idx):
        with open(idx) as handle:
            return json.load(handle)["weight_map"]
    raise CheckpointError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path} (only safetensors checkpoints are read)")


def load_weights(model, path) -> None:
    """Read every tensor of the checkpoint at `path` into the slid model's masters, one at a time (a
    mixture of experts stored one tensor per expert is stacked as HF stacks it: expert_layout.py)."""
    store = model.slide_engine.store
    check = model.slide_engine.config.check_finite_weights
    weight_map = _index(path)
    expected = {}
    for unit in store.units:
        for entry in unit.entries:
            expected[entry.name] = (unit, entry)
    tied = model.slide_engine.tied
    missing = [n for n in expected if n not in weight_map]
    packed = {n for n in missing if all(n + end in weight_map for end in _PACKED)}     # MXFP4 weights
    missing = [n for n in missing if n not in packed]
    stacked = {n: src for n in missing if (src := per_expert_sources(n, weight_map))}      # one tensor per expert
    aliases = {n: src for n in missing if n not in stacked and (src := renamed_source(n, weight_map))}
    missing = [n for n in missing if n not in stacked and n not in aliases]
    if tied:
        for name in list(missing):
            alt = "lm_head.weight"
            if name.endswith("embed_tokens.weight") and alt in weight_map:
                aliases[name] = alt
                missing.remove(name)
    elif getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in missing:
        # PEFT's modules_to_save untied a tied model (modules_to_save.py): its lm_head, a copy or the
        # frozen original, starts as the checkpoint's one table.
        alt = next((n for n in weight_map if n.endswith("embed_tokens.weight")), None)
        if alt is not None:
            aliases["lm_head.weight"] = alt
            missing.remove("lm_head.weight")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s): {', '.join(missing[:20])}"
                              f"{' ...' if len(missing) > 20 else ''}")
    by_file: dict[str, list[str]] = {}
    for name in expected:
        src = (name + _PACKED[0] if name in packed else stacked[name][0][0] if name in stacked
               else aliases.get(name, name))
        by_file.setdefault(weight_map[src], []).append(name)
    mismatched = []
    # HF's own bar: silenced as HF's loading bar is (`transformers.utils.logging.disable_progress_bar()`).
    bar = hf_logging.tqdm(total=sum(u.numel for u in store.units) * 4, unit="B", unit_scale=True,
                          desc="loading weights into host memory", disable=sum(u.numel for u in store.units) < 50_000_000)
    with torch.no_grad():
        for fname, names in by_file.items():
            fpath = os.path.join(path, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"checkpoint file {fpath} named in the index does not exist")
            with safe_open(fpath, "pt") as handle:
                # one unit at a time: a layer on disk is read in and written back once per file
                for _, group in itertools.groupby(names, key=lambda n: id(expected[n][0])):
                    group = list(group)
                    unit = expected[group[0]][0]
                    with store.unit_state(unit, write=True):
                        for name in group:
                            entry = expected[name][1]
                            tensor = (_dequantized(handle, fname, path, weight_map, name) if name in packed
                                      else read_stacked(path, weight_map, stacked[name]) if name in stacked
                                      else handle.get_tensor(aliases.get(name, name)))
                            if check:
                                check_finite(name, tensor, f"in {fpath}")
                            if tuple(tensor.shape) != tuple(entry.shape):
                                mismatched.append(
                                    f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(entry.shape)}")
                                continue
                            entry.view(unit.master).copy_(tensor)
                            bar.update(entry.numel * 4)
    bar.close()
    if mismatched:
        raise CheckpointError(f"checkpoint {path} has tensors of the wrong shape: {'; '.join(mismatched[:20])}")
    unexpected = set(weight_map) - {aliases.get(n, n) for n in expected} - {n + end for n in packed for end in _PACKED}
    unexpected -= {src for groups in stacked.values() for group in groups for src in group}
    unexpected -= set(persistent_buffers(model))
    unexpected = {n for n in unexpected if not (tied and n == "lm_head.weight")}
    if unexpected:
        logger.warning("checkpoint tensors not used by the model: %s", sorted(unexpected)[:20])


def _dequantized(handle, fname: str, path: str, weight_map: dict[str, str], name: str) -> torch.Tensor:
    """The fp32 weight `name` of an MXFP4 checkpoint from its blocks (read from the open file `handle`)
    and its scales (their file may be another shard)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = handle.get_tensor(name + _PACKED[0])
    scales_file = weight_map[name + _PACKED[1]]
    if scales_file == fname:
        scales = handle.get_tensor(name + _PACKED[1])
    else:
        with safe_open(os.path.join(path, scales_file), "pt") as scales_handle:
            scales = scales_handle.get_tensor(name + _PACKED[1])
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    size = size.strip().upper()
    for suf, mul in (("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3), ("GIB", 2 ** 30), ("MIB", 2 ** 20)):
        if size.endswith(suf):
            return int(float(size[: -len(suf)]) * mul)
    return int(size)


def _referenced(directory: str) -> set[str]:
    """The weight files a loader reads in `directory` now (empty if none)."""
    if os.path.isfile(os.path.join(directory, WEIGHTS_NAME)):
        return {WEIGHTS_NAME}
    try:
        with open(os.path.join(directory, INDEX_NAME)) as handle:
            return {INDEX_NAME} | set(json.load(handle)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _shard_plan(eng, limit: int, dtype) -> list[list[tuple[str, object, object]]]:
    """Units' tensors grouped into shards of at most `limit` bytes (a larger tensor gets its own)."""
    size = 0
    plan: list[list[tuple[str, object, object]]] = [[]]
    for unit in eng.store.units:
        for entry in unit.entries:
            nbytes = entry.numel * torch.finfo(dtype).bits // 8
            if plan[-1] and size + nbytes > limit:
                plan.append([])
                size = 0
            plan[-1].append((entry.name, unit, entry))
            size += nbytes
    return plan


def _shard_names(count: int, taken: set[str]) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    names = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    if taken & set(names):
        names = [f"model-b-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    return names


def _dtype_bits(directory: str) -> int:
    """Bits per weight of the save in `directory` by its config (0: none readable)."""
    try:
        with open(os.path.join(directory, CONFIG_NAME)) as handle:
            cfg = json.load(handle)
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        return torch.finfo(getattr(torch, name)).bits
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _same_file(path1: str, path2: str) -> bool:
    try:
        with open(path1, "rb") as fa, open(path2, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def save_model(model, save_directory, max_shard_size="5GB", dtype=torch.float32) -> None:
    """Write the masters of a slid model as HF sharded safetensors + config (+ generation config).

    Over an earlier save, the directory loads as the old save or the new one at every step,
    whenever the process is killed (see the module note); other files in it are left alone.

    Raises:
        ConcurrentSaveError: another thread of this process is saving into `save_directory`.
    """
    os.makedirs(save_directory, exist_ok=True)
    with one_save_at_a_time(save_directory):
        _save_model(model, save_directory, max_shard_size, dtype)


def _save_model(model, save_directory, max_shard_size, dtype) -> None:
    eng = model.slide_engine
    limit = _parse_size(max_shard_size)
    remove_leftovers(save_directory, STAGING)
    committed = _referenced(save_directory)
    plan = _shard_plan(eng, limit, dtype)
    names = _shard_names(len(plan), committed)
    stage = leftover_path(save_directory, STAGING, "model")
    os.mkdir(stage)
    try:
        _write(model, stage, plan, names, dtype)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _commit(save_directory, stage, names, wider=torch.finfo(dtype).bits >= _dtype_bits(save_directory))
    logger.info("Model weights saved in %s", save_directory)


def _write(model, stage: str, plan, names: list[str], dtype) -> None:
    """Every file of the new save, fsynced, in the staging folder."""
    weight_map, total = {}, 0
    store = model.slide_engine.store
    for fname, items in zip(names, plan):
        tensors = {}
        for _, group in itertools.groupby(items, key=lambda item: id(item[1])):
            group = list(group)
            unit = group[0][1]
            with store.unit_state(unit):                  # a layer on disk: read in, and copied out below
                for name, _, entry in group:
                    tensor = entry.view(unit.master).to(dtype).contiguous()  # fp32: the master itself
                    copy = store.on_disk(unit) and tensor.dtype == unit.master.dtype
                    tensors[name] = tensor.clone() if copy else tensor
        if fname == names[-1]:
            tensors.update({n: b.detach().to("cpu").contiguous() for n, b in persistent_buffers(model).items()})
        save_file(tensors, os.path.join(stage, fname), metadata={"format": "pt"})
        fsync_file(os.path.join(stage, fname))
        for name in tensors:
            weight_map[name] = fname
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(names) > 1:
        with open(os.path.join(stage, INDEX_NAME), "w") as handle:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
    cfg = model.config
    old_arch, old_dtype = getattr(cfg, "architectures", None), getattr(cfg, "dtype", None)
    cfg.architectures = [model._slide_base_class.__name__]
    cfg.dtype = dtype
    try:
        cfg.to_json_file(os.path.join(stage, CONFIG_NAME))
    finally:
        cfg.architectures, cfg.dtype = old_arch, old_dtype
    fsync_file(os.path.join(stage, CONFIG_NAME))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.to_json_file(os.path.join(stage, GENERATION_CONFIG_NAME))
            fsync_file(os.path.join(stage, GENERATION_CONFIG_NAME))
        except Exception:  # noqa: BLE001 - a generation config is optional
            with contextlib.suppress(OSError):
                os.remove(os.path.join(stage, GENERATION_CONFIG_NAME))
    fsync_dir(stage)


def _commit(directory: str, stage: str, names: list[str], wider: bool) -> None:
    """Move the staged save in, in the order of the module note; each step is one rename or removal."""
    def configs():
        for name in (CONFIG_NAME, GENERATION_CONFIG_NAME):
            src, dst = os.path.join(stage, name), os.path.join(directory, name)
            if os.path.isfile(src) and not _same_file(src, dst):
                os.replace(src, dst)

    sharded = len(names) > 1
    if sharded:
        for name in names:
            os.replace(os.path.join(stage, name), os.path.join(directory, name))
    if wider:
        configs()
    if sharded:
        os.replace(os.path.join(stage, INDEX_NAME), os.path.join(directory, INDEX_NAME))
        if os.path.isfile(os.path.join(directory, WEIGHTS_NAME)):
            os.remove(os.path.join(directory, WEIGHTS_NAME))
    else:
        os.replace(os.path.join(stage, WEIGHTS_NAME), os.path.join(directory, WEIGHTS_NAME))
    if not wider:
        configs()
    fsync_dir(directory)
    keep = set(names) | ({INDEX_NAME} if sharded else set())
    stale = [INDEX_NAME] if not sharded and os.path.isfile(os.path.join(directory, INDEX_NAME)) else []
    stale += sorted(e for e in os.listdir(directory) if _SHARD.match(e) and e not in keep)
    for name in stale:                        # the index first: it must never name a removed shard
        os.remove(os.path.join(directory, name))
    shutil.rmtree(stage, ignore_errors=True)
    fsync_dir(directory)
