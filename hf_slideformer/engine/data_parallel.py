"""Data parallelism over the GPUs of one host: N processes slide the same layers over their own
micro-batches and share one copy of the host state.

Launched by `torchrun --nproc_per_node N` (or any launcher that sets RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT, or with a process group already initialized), `slide()` finds the
group (`DataParallel.from_environment`) and every unit becomes *sharded*:

| what | one process | N ranks |
|---|---|---|
| masters and AdamW moments | host memory of the process | one copy per host, in shared memory (`SharedHostMemory`) |
| a unit's gradient | d2h of the whole unit | summed over the ranks on the devices (`reduce_scatter`), times 1/N; each rank copies out only its shard |
| the update | the CPU worker, the whole unit | each rank's worker, its shard [lo, hi) of the unit (`span`) |
| the step's norm | the device's running sum | each rank adds its shards' squares, summed over the ranks (`all_sum` on the device, `worker_sum` on the workers) |
| the next forward | waits for the unit's update | waits for every rank's update: the workers are joined and the ranks meet (`barrier`) at `optimizer.step()` |

So each byte of gradient crosses PCIe once in total, the CPU AdamW runs once per parameter, and
host memory holds one copy of the state plus each rank's ring, row buffers and layer inputs. The
ranks average their gradients, as DistributedDataParallel does: the same global batch split over
N ranks gives the one-process step.

Three process groups keep collectives from different threads apart: the default group for the
gradients and the norm (NCCL on CUDA, gloo on the CPU, issued by the main thread in schedule
order), a gloo group for the CPU workers' scalars (issued in task order, the same on every
rank), and a gloo group for the main thread's host-side meetings (shared-memory names, the step
barrier). Every rank runs the same tasks for every unit, so the collectives pair up.

Not supported with several processes (each raises, naming the option): resident units and device
updates (every update is the host's), `host_memory_limit`, LoRA and other frozen parameters. A
failing rank leaves the others in a collective; the launcher (torchrun, `mp.spawn`) ends them.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid

import torch
import torch.distributed as dist

from ..config import worker_threads
from ..errors import RankMismatchError, RankTimeoutError
from ..host.memory import HostMemoryError
from .slide_checks import compare_ranks

logger = logging.getLogger(__name__)

__all__ = ["DataParallel", "SharedHostMemory", "SHM_DIR_ENV", "check_one_host", "world_size"]

SHM_DIR_ENV = "HF_SLIDEFORMER_SHM_DIR"     # share the state through files in this directory, not memory files


def check_one_host(hosts: list[str]) -> None:
    """Refuse ranks on several hosts (`hosts`: each rank's host name): they share one copy of the
    state in one host's memory."""
    if len(set(hosts)) > 1:
        raise ValueError(f"hf_slideformer was launched on several hosts ({', '.join(sorted(set(hosts)))}): its data "
                         "parallelism shares the host state among the GPUs of one host. Launch on one host, or for "
                         "several hosts use FSDP or DeepSpeed without sliding.")


def world_size() -> int:
    """The number of processes of the launch: the initialized group's, else the launcher's WORLD_SIZE."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


class DataParallel:
    """This process's place in the group: its rank, the groups, the shards, the collectives.

    Build it with `from_environment`.
    """

    def __init__(self, rank_timeout: float = 600.0):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.worker_group = dist.new_group(backend="gloo")
        self.host_group = dist.new_group(backend="gloo")
        # The ranks meet on this group before each training forward's first collective (`meet`).
        self.rank_timeout = rank_timeout
        self.step_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=rank_timeout))
        hosts = [None] * self.world
        dist.all_gather_object(hosts, socket.gethostname(), group=self.host_group)
        check_one_host(hosts)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def from_environment(cls, config, frozen: bool = False) -> DataParallel | None:
        """The group of this launch, or None for one process. Initializes the default group from
        the launcher's environment when nobody has (NCCL for a CUDA device, else gloo), moves a
        bare "cuda" device to this rank's GPU (LOCAL_RANK), and refuses what stays unsupported.
        `config` is the engine's own SlideConfig (changed in place)."""
        if world_size() <= 1 or not dist.is_available():
            return None
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if config.is_cuda else "gloo")
        if config.is_cuda and config.torch_device.index is None:
            local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(1, torch.cuda.device_count())))
            config.device = f"cuda:{local}"
        if config.is_cuda:
            torch.cuda.set_device(config.torch_device)
        unsupported = []
        if config.host_memory_limit is not None:
            unsupported.append("host_memory_limit (state on disk)")
        if config.resident_layers not in ("auto", 0):
            unsupported.append(f"resident_layers={config.resident_layers!r} (use 0)")
        if config.resident_embedding not in ("auto", False):
            unsupported.append(f"resident_embedding={config.resident_embedding!r} (use False)")
        if config.device_update_share not in ("auto", 0, 0.0):
            unsupported.append(f"device_update_share={config.device_update_share!r} (use 0)")
        if config.optimizer_state != "adamw":
            # Each rank updates a flat 1/N of every unit (`span`), from a reduce-scatter of equal
            # shards; an 8-bit update starts at a block of 256 values of a parameter, so its shards
            # would have to follow the parameters' blocks, which the collectives do not.
            unsupported.append(f"optimizer_state={config.optimizer_state!r} (use 'adamw': the ranks' shards are "
                               "flat ranges of a unit, the 8-bit moments' blocks of 256 follow its parameters)")
        if frozen:
            unsupported.append("frozen parameters (a LoRA / PEFT model, or requires_grad=False): every parameter "
                               "must train")
        if unsupported:
            raise ValueError(f"with {dist.get_world_size()} processes hf_slideformer does not support "
                             f"{'; '.join(unsupported)}. Train with one process for these, or leave them out.")
        # Every update runs on the hosts' workers, sharded: nothing stays on or is updated by a GPU.
        config.resident_layers, config.resident_embedding, config.device_update_share = 0, False, 0.0
        if getattr(config, "_auto_threads", False):
            # The ranks' workers share the host's cores (and its memory bandwidth): each its part.
            config.cpu_threads = worker_threads(max(1, (os.cpu_count() or 1) // world_size()))
        dp = cls(config.rank_timeout)
        logger.info("data parallel: rank %d of %d, device %s", dp.rank, dp.world, config.device)
        return dp

    # ------------------------------------------------------------------ shards
    def per_rank(self, numel: int) -> int:
        """Elements of each rank's shard of a unit of `numel` (the last may hold padding)."""
        return -(-numel // self.world)

    def span(self, numel: int) -> tuple[int, int]:
        """This rank's shard [lo, hi) of a unit of `numel` elements (possibly empty)."""
        per = self.per_rank(numel)
        lo = min(numel, self.rank * per)
        return lo, min(numel, lo + per)

    # ------------------------------------------------------------------ collectives: main thread
    def reduce_grads(self, numel: int, grads: list, offsets: list[int], dtype, device, scale=None) -> torch.Tensor:
        """This rank's shard of the ranks' mean gradient of a unit: `grads` (entry tensors on the
        device, None for zeros) at `offsets` of a flat (numel,) layout, times `scale` (a device
        scalar) first. Returns (hi - lo,) on the device."""
        per = self.per_rank(numel)
        flat = torch.zeros(per * self.world, dtype=dtype, device=device)
        for grad, off in zip(grads, offsets):
            if grad is not None:
                flat[off:off + grad.numel()].copy_(grad.reshape(-1))
        return self.reduce_flat(flat, numel, scale)

    def reduce_flat(self, flat: torch.Tensor, numel: int, scale=None) -> torch.Tensor:
        """As `reduce_grads`, for a flat (per_rank * world,) gradient (consumed)."""
        if scale is not None:
            flat.mul_(scale)
        out = flat.new_empty(self.per_rank(numel))
        dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM)
        lo, hi = self.span(numel)
        return out[:hi - lo].mul_(1.0 / self.world)

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a device tensor) summed over the ranks, in place."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    # ------------------------------------------------------------------ collectives: host side
    def worker_sum(self, value: float) -> float:
        """Worker thread: `value` summed over the ranks' workers."""
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.worker_group)
        return float(total[0])

    def barrier(self) -> None:
        """Main thread: every rank gets here before any goes on."""
        dist.barrier(group=self.host_group)

    def broadcast(self, obj):
        """Main thread: rank 0's `obj`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def check_same(self, fingerprint: dict) -> None:
        """Main thread, at `slide()`: every rank's `fingerprint` (`slide_checks.rank_fingerprint`)
        is rank 0's, else every rank raises `RankMismatchError` naming the first difference."""
        prints = [None] * self.world
        dist.all_gather_object(prints, fingerprint, group=self.host_group)
        compare_ranks(prints)

    def meet(self, values: dict) -> None:
        """Main thread, before a training forward's first collective: every rank has the same
        `values` (its optimizer step and micro-batch, and the step's settings that change the
        mathematics: accumulation, clipping, the optimizer's hyper-parameters).

        Note: [Why the ranks meet before each training forward] a rank that runs more steps than
        its peers would otherwise wait in the gradient's collective for a peer that never comes,
        for as long as the default group's timeout (30 minutes for gloo; a launcher's own group
        may have none). The meeting is a gloo all-gather of a few numbers on a group of its own
        whose timeout is `SlideConfig.rank_timeout`: a lone rank stops within that bound with an
        error naming the step, and ranks that differ (a skipped micro-batch, another learning
        rate or clipping threshold) stop at once, naming what differs. Its cost is one small
        host-side collective per micro-batch (well under a millisecond on one host).

        Raises:
            RankTimeoutError: no peer came within `rank_timeout` seconds (or a peer is gone).
            RankMismatchError: the ranks differ in one of `values`.
        """
        every = [None] * self.world
        try:
            dist.all_gather_object(every, values, group=self.step_group)
        except RuntimeError as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise RankTimeoutError(
                f"rank {self.rank} waited {self.rank_timeout:g} s (SlideConfig.rank_timeout) for the other ranks at "
                f"optimizer step {values.get('optimizer step')}, micro-batch {values.get('micro-batch')}: a rank ran "
                f"fewer steps than this one, or stopped ({type(e).__name__}: {first}). Give every rank the same "
                "number of batches (as DistributedSampler(drop_last=True) does).") from e
        compare_ranks(every)

    @property
    def writes(self) -> bool:
        """Does this rank write the files (checkpoints, saved models)? Rank 0."""
        return self.rank == 0


class SharedHostMemory:
    """The host store's memory when several ranks share it, mapped by every rank. Rank 0 makes each
    buffer: an anonymous memory file (`memfd_create`), which the other ranks open through
    `/proc/<rank 0>/fd/<n>`. It has no name and no size limit of its own: the memory goes back
    when the last process that maps it ends, killed or not. With `$HF_SLIDEFORMER_SHM_DIR` (or where
    the system has no memory files) it is a file in that directory (default `/dev/shm`) instead,
    created at its full size and unlinked once every rank has mapped it. Pages are backed as they
    are written (they read as zeros).

    Args:
        dp: the DataParallel.
        pinned: the PinnedBuffers that page-lock `empty` buffers on CUDA (each rank registers the
            same pages for its own copies).
    """

    def __init__(self, dp: DataParallel, pinned):
        self.dp, self.pinned = dp, pinned
        self.dir = os.environ.get(SHM_DIR_ENV) or (None if hasattr(os, "memfd_create") else "/dev/shm")

    def _make(self, nbytes: int) -> tuple[str, int | None]:
        """Rank 0: a new buffer of `nbytes`; (the path the ranks map, the descriptor to close after),
        or ("!why", None)."""
        name = f"hf_slideformer-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        if self.dir is None:
            try:
                fd = os.memfd_create(name)
                os.ftruncate(fd, nbytes)
            except OSError as exc:
                return f"!a memory file could not be made: {exc}", None
            return f"/proc/{os.getpid()}/fd/{fd}", fd
        try:
            st = os.statvfs(self.dir)
            free = st.f_bavail * st.f_frsize
        except OSError as exc:
            return f"!{self.dir} is unusable: {exc}", None
        if free < nbytes:
            return f"!{self.dir} has {free / 2 ** 30:.1f} GiB free of the {nbytes / 2 ** 30:.1f} GiB needed", None
        path = os.path.join(self.dir, name)
        with open(path, "wb") as file:
            file.truncate(nbytes)
        return path, None

    def _map(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        nbytes = numel * dtype.itemsize
        path, fd = self._make(nbytes) if self.dp.rank == 0 else (None, None)
        path = self.dp.broadcast(path)
        if path.startswith("!"):
            raise HostMemoryError(
                f"the ranks' shared state needs {nbytes / 2 ** 30:.1f} GiB of shared memory: {path[1:]}. Point "
                f"{SHM_DIR_ENV} at a RAM file system that has room (docker: --shm-size for /dev/shm).")
        failed = None
        try:
            tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        except (RuntimeError, OSError) as exc:
            failed = exc
        finally:
            self.dp.barrier()              # every rank has mapped it (or failed to)
            if self.dp.rank == 0:
                if fd is not None:
                    os.close(fd)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        if failed is not None:
            raise HostMemoryError(f"rank {self.dp.rank} could not map the ranks' shared state at {path}: {failed}. "
                                  f"Set {SHM_DIR_ENV} to a RAM file system (such as /dev/shm) to share it through "
                                  "files there.") from failed
        return tensor

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A shared buffer the copies read (page-locked on CUDA)."""
        return self.pinned.adopt(self._map(numel, dtype))

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A shared zero-filled buffer, backed as it is written (the moments)."""
        return self._map(numel, dtype)
