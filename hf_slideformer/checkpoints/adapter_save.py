"""`save_pretrained` of a slid PEFT model, crash-consistent as the full model's is: a save over an
earlier adapter loads, whenever the process is killed, as the old adapter or the new one (with
`PeftModel.from_pretrained`), never as neither.

PEFT writes its files in place (`adapter_model.safetensors`, `adapter_config.json`, a model card),
so a kill in the middle of the weights leaves a folder that does not load and the earlier adapter
gone. Here PEFT writes into a hidden staging folder inside the directory (its name attributes it to
this process, `atomic_save.leftover_path`), everything is fsynced, and the files move into place
by renames (see the Note). The directory's other files (a tokenizer, the Trainer's `checkpoint-N`
folders) are left alone; staging folders of killed saves are removed by the next save.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil

from .atomic_save import fsync_dir, fsync_tree, leftover_path, one_save_at_a_time, remove_leftovers

__all__ = ["save_adapter", "slid_peft_class"]

logger = logging.getLogger(__name__)

STAGING = "slide-save"
_WEIGHTS = (".safetensors", ".bin")


def _same_file(path1: str, path2: str) -> bool:
    try:
        if os.path.getsize(path1) != os.path.getsize(path2):
            return False
        with open(path1, "rb") as fa, open(path2, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def _files(stage: str) -> list[str]:
    """The staged files (paths relative to the stage), weights last."""
    out = []
    for root, _, files in os.walk(stage):
        out += [os.path.relpath(os.path.join(root, f), stage) for f in files]
    return sorted(out, key=lambda p: (p.endswith(_WEIGHTS), p))


def save_adapter(save, save_directory: str, **kwargs) -> None:
    """Run PEFT's save (`save(directory, **kwargs)`) into a staging folder, then commit it.

    Note: [Why an adapter save is old or new at every step] each step of the commit is one
    rename: first the files that differ besides the weights (the config, the model card), then
    each weights file (`adapter_model.safetensors`, one per adapter), each replacing the old one
    whole. Until the weights' rename the folder loads as the old adapter, after it as the new one.
    A config that changes the adapter's shape (its rank, its targets) between two saves makes the
    one step between the config's rename and the weights' a state that loads as neither: PEFT
    refuses the old weights under the new rank (it never loads a mix silently); saves of one
    training run keep their config, so their commit is the weights' rename alone.
    """
    save_directory = os.path.abspath(os.fspath(save_directory))
    os.makedirs(save_directory, exist_ok=True)
    with one_save_at_a_time(save_directory):
        _commit(save, save_directory, kwargs)
    logger.info("adapter saved in %s", save_directory)


def _commit(save, save_directory: str, kwargs: dict) -> None:
    remove_leftovers(save_directory, STAGING)
    stage = leftover_path(save_directory, STAGING, "adapter")
    os.mkdir(stage)
    try:
        save(stage, **kwargs)
        fsync_tree(stage)
        for rel in _files(stage):
            src, dst = os.path.join(stage, rel), os.path.join(save_directory, rel)
            if _same_file(src, dst):
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            fsync_dir(os.path.dirname(dst))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def slid_peft_class(cls: type) -> type:
    """The class a slid PEFT model takes: `cls` with a crash-consistent `save_pretrained`."""

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """PEFT's `save_pretrained`, crash-consistent over an earlier save (adapter_save.py)."""
        if not is_main_process:
            return cls.save_pretrained(self, save_directory, *args, is_main_process=False, **kwargs)
        save = functools.partial(cls.save_pretrained, self)
        return save_adapter(lambda d, **kw: save(d, *args, **kw), save_directory, **kwargs)

    return type(cls.__name__, (cls,), {"save_pretrained": save_pretrained, "__module__": cls.__module__,
                                       "_slide_peft_base_class": cls})
