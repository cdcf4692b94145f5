"""The advice of a `Plan`: what to change, drawn from its shortfalls (host, GPU, disk) and its
binding term. Each item asks `plan_estimate`'s formulas (and a few sums of the shape's sizes)
what another setting would cost or save.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..host.host_optim import embed_format, state_format
from ..host.memory import GiB
from .plan_estimate import ENGINE_EFFICIENCY, GRAD_BYTES, PROCESS_HOST_BYTES, Estimator, ModelShape, batch_limit, gpu_binds
from .plan_report import Plan, disk_parts, gib

__all__ = ["advise"]


def advise(plan: Plan, est: Estimator, deferred: bool) -> list[str]:
    """What to change, from the plan's shortfalls and its binding term."""
    return (_input_advice(plan) + _host_advice(plan, est, deferred) + _gpu_memory_advice(plan, est)
            + _bound_advice(plan, est, deferred))


def _input_advice(plan: Plan) -> list[str]:
    """A sequence beyond the model's positions; the layers the plan puts on disk, and a disk too small."""
    out, shape = [], plan.shape
    if shape.max_positions and plan.seq > shape.max_positions:
        out.append(f"seq {plan.seq} is beyond this model's max_position_embeddings ({shape.max_positions}): it was not "
                   f"trained on such positions; plan with --seq {shape.max_positions} or raise the limit in its config")
    if plan.disk_layers:
        out.append(f"{disk_parts(plan)} on disk: SlideConfig(host_memory_limit={plan.host_memory_limit_gib}, "
                   "nvme_path=<a directory on that disk>)")
    if plan.disk_fits is False:
        out.append(f"disk short by {(plan.disk_state_bytes - plan.disk_mem_bytes) / 1e9:.0f} GB: the state file of the "
                   f"{plan.disk_layers} layers on disk takes {plan.disk_state_bytes / 1e9:.0f} GB (one record each, of "
                   "the moments or the whole state in the optimizer state format: docs/disk.md); free space there or use a larger disk")
    return out


def _host_advice(plan: Plan, est: Estimator, deferred: bool) -> list[str]:
    """When host memory is short: by how much, and each setting that saves some, with what it saves."""
    if plan.host_fits is not False:
        return []
    shape, gpus, tier = plan.shape, plan.gpus, plan.activation_tier
    short = plan.host_total - plan.host_mem_bytes
    fixes = []
    compact = {"adamw": "adamw_8bit", "adamw_8bit": "adamw_8bit_bf16"}.get(plan.optimizer_state)
    if compact and not plan.lora_r and gpus == 1:
        fixes.append(f"optimizer_state='{compact}' (--optim {compact}) saves "
                     f"{gib(_state_saving(shape, plan.optimizer_state, compact))} (docs/host_state.md)")
    if plan.disk_mem_bytes is None and gpus == 1:
        fixes.append("a disk for the state (--nvme-gb, SlideConfig.host_memory_limit with nvme_path) keeps the "
                     "last layers' masters and moments there")
    if deferred:
        fixes.append(f"no clipping and no accumulation (max_grad_norm=None, gradient_accumulation_steps=1) "
                     f"saves {gib(est.accumulator_bytes())}")
    acts = plan.host[est.per_gpu(f"layer inputs ({tier} tier)")]
    if tier == "cpu" and acts:
        if est.gpu_peak(plan.batch, "device") <= plan.gpu_limit:
            fixes.append(f"activation_tier='device' saves {gib(acts)} (the GPU has room for them)")
        saved = acts - est.host(plan.batch, "nvme", deferred)[est.per_gpu("layer inputs (nvme tier)")]
        fixes.append(f"activation_tier='nvme' saves {gib(saved)} (costs about "
                     f"{est.times(plan.batch, plan.gradient_accumulation_steps, 'nvme')['disk']:.1f} s of disk time "
                     f"per step)")
    if plan.grad_buffers > 2:
        fixes.append(f"grad_buffers=2 saves {gib(gpus * GRAD_BYTES * (plan.grad_buffers - 2) * shape.layer_params)}")
    if plan.max_batch_host and plan.max_batch_host < plan.batch:
        fixes.append(f"batch {plan.max_batch_host} fits")
    floor = est.state_bytes() + 4 * shape.embed_params + gpus * PROCESS_HOST_BYTES
    msg = f"host memory short by {gib(short)}: " + "; ".join(fixes) if fixes else \
        f"host memory short by {gib(short)}"
    if plan.host_mem_bytes < floor:
        msg += (f". Masters, moments and the embedding gradient alone need {gib(floor)}: use a host with "
                "more memory or a smaller model" + (f", or fewer GPUs than {gpus}" if gpus > 1 else ""))
    return [msg]


def _gpu_memory_advice(plan: Plan, est: Estimator) -> list[str]:
    """When GPU memory is short: the largest batch that fits, and the accumulation that keeps the step's sequences."""
    if plan.gpu_fits:
        return []
    largest = plan.max_batch_gpu
    if largest < 1:
        return [f"GPU memory short by {gib(plan.gpu_peak - plan.gpu_limit)} even at batch 1: lower seq, use "
                "window=1, or a GPU with more memory"]
    micro = plan.batch * plan.gradient_accumulation_steps
    steps = math.ceil(micro / largest)
    return [f"GPU memory short by {gib(plan.gpu_peak - plan.gpu_limit)} at batch {plan.batch}: the largest batch "
            f"that fits is {largest}; batch {largest} with gradient_accumulation_steps={steps} keeps about "
            f"{micro} sequences per step (+{gib(est.accumulator_bytes())} of host "
            "memory for the accumulator)"]


def _bound_advice(plan: Plan, est: Estimator, deferred: bool) -> list[str]:
    """What the binding term asks for: a larger batch or accumulation to hide the CPU or PCIe, the disk's
    traffic, or, GPU-bound, nothing but faster kernels."""
    if plan.bound_by in ("cpu", "pcie"):
        return _transfer_or_update_advice(plan, est, deferred)
    if plan.bound_by == "disk":
        return _disk_bound_advice(plan, est, deferred)
    if plan.paced_by not in ("", "gpu"):
        term = plan.times[plan.paced_by]
        return [f"GPU-bound, but close: the {plan.paced_by} term ({term:.3f} s at its full rate) runs at about "
                f"{ENGINE_EFFICIENCY[plan.paced_by]:.2f} of it in the pipeline and so sets the expected step; a "
                "larger batch hides it behind the compute"]
    out = ["GPU-bound: AdamW and the transfers hide behind the compute; only faster kernels or a faster "
           "GPU raise tokens/s"]
    spare = GRAD_BYTES * (plan.grad_buffers - 3) * plan.shape.layer_params
    if not deferred and plan.grad_buffers > 3 and spare >= GiB // 10:
        # 3 buffers cost nothing while the GPU is the bound and nothing is clipped or
        # accumulated; they slow a step the CPU paces (docs/benchmarks.md).
        out.append(f"grad_buffers=3 saves {gib(plan.gpus * spare)} of host memory at "
                   "no cost while the GPU is the bound and nothing is clipped or accumulated")
    return out


def _transfer_or_update_advice(plan: Plan, est: Estimator, deferred: bool) -> list[str]:
    """CPU- or PCIe-bound: the batch that hides the term behind the GPU, else accumulation (CPU) or a
    larger window (PCIe), and the device activation tier where it fits."""
    out, micro, tier, times = [], plan.gradient_accumulation_steps, plan.activation_tier, plan.times
    what = {"cpu": f"AdamW ({times['cpu']:.2f} s)", "pcie": f"the transfers ({times['pcie']:.2f} s)"}[plan.bound_by]
    batch = est.hiding_batch(micro, tier, batch_limit(plan.max_batch_gpu, plan.max_batch_host), deferred)
    at_batch = est.times(batch, micro, tier, deferred) if batch else {}
    hides = bool(at_batch) and gpu_binds(at_batch)
    if batch > plan.batch:
        out.append(f"{plan.bound_by.upper()}-bound: raise the batch to {batch} to hide {what} behind the GPU's "
                   f"compute ({at_batch['gpu']:.2f} s at batch {batch}"
                   + ("" if hides else f", still short of {max(at_batch.values()):.2f} s") + ")")
    steps = (next((k for k in range(2, 65) if gpu_binds(est.times(batch, k, tier, True))), None)
             if batch else None)
    if batch and not hides and plan.bound_by == "cpu" and steps:
        need = sum(est.host(batch, tier, True).values())
        room = ("" if plan.host_mem_bytes is None else
                "; it fits in host memory" if need <= plan.host_mem_bytes else
                f"; that needs {gib(need)} of host memory, more than the {gib(plan.host_mem_bytes)} there is")
        out.append(f"CPU-bound at the largest batch that fits ({batch}): gradient_accumulation_steps={steps} hides "
                   f"AdamW behind {steps} micro-batches (the fp32 accumulator adds "
                   f"{gib(est.accumulator_bytes())}{room}), or use a host with a faster AdamW "
                   "(more cores, more memory bandwidth)")
    share = _device_share_advice(plan, est, deferred)
    if share:
        out.append(share)
    if batch and not hides and plan.bound_by == "pcie":
        out.append(f"PCIe-bound at the largest batch that fits ({batch}): the weights cross PCIe twice per "
                   "micro-batch whatever its size; a larger window re-sends fewer layers in backward")
    if plan.bound_by == "pcie" and tier == "cpu" and est.gpu_peak(plan.batch, "device") <= plan.gpu_limit:
        out.append("activation_tier='device' fits on this GPU and takes the layer inputs off PCIe")
    return out


def _device_share_advice(plan: Plan, est: Estimator, deferred: bool) -> str:
    """CPU-bound without clipping at this batch: the device_update_share (a multiple of 0.05, the
    smallest of the best) whose expected step is shortest, each term at its share of its rate in
    the pipeline (ENGINE_EFFICIENCY), the link carrying the device layers' state both ways."""
    if plan.bound_by != "cpu" or deferred or plan.gpus > 1 or plan.lora_r or est.device_share:
        return ""
    res = (plan.resident_embedding, plan.resident_layers)

    def step(share: float) -> tuple[float, dict]:
        times = replace(est, device_share=share).times(plan.batch, plan.gradient_accumulation_steps,
                                                       plan.activation_tier, False, res)
        return max(v / ENGINE_EFFICIENCY.get(k, 1.0) for k, v in times.items()), times

    now = step(0.0)[0]
    best_s, share = min((step(k / 20)[0], k / 20) for k in range(1, 19))
    if best_s > 0.95 * now:
        return ""
    times = step(share)[1]
    return (f"CPU-bound without clipping: device_update_share={share} updates that share of the streamed layers on the "
            f"GPU in their backward (cpu {times['cpu']:.2f} s, their state on the link: pcie {times['pcie']:.2f} s, "
            f"GPU {times['gpu']:.2f} s; expected step {best_s:.2f} s against {now:.2f} s)")


def _disk_bound_advice(plan: Plan, est: Estimator, deferred: bool) -> list[str]:
    """Disk-bound: what the layers on disk move per step and what would shorten it; the nvme tier's traffic."""
    out, shape = [], plan.shape
    if plan.disk_layers:
        fmt = state_format(plan.optimizer_state or "adamw")     # its moments alone, or master and moments
        moments = fmt.bytes_per_param - fmt.master_dtype.itemsize
        more = int((moments * plan.disk_moment_layers + fmt.bytes_per_param * plan.disk_whole_layers)
                   * shape.layer_params)
        out.append(f"disk-bound: the state of the {plan.disk_layers} layers on disk moves "
                   f"{plan.disk_bytes_per_step / 1e9:.0f} GB per step at {plan.rates['nvme_bw']} GB/s; it does not "
                   f"grow "
                   f"with the batch, so a larger batch (or gradient accumulation) spreads it over more tokens; "
                   f"{gib(more)} more host memory keeps every layer in RAM; a faster disk (or several in RAID 0) "
                   "shortens it")
    if plan.activation_tier == "nvme":
        need = est.host(plan.batch, "cpu", deferred)[est.per_gpu("layer inputs (cpu tier)")]
        traffic = 2 * shape.layers * plan.batch * plan.seq * shape.hidden * plan.gradient_accumulation_steps * plan.gpus
        out.append(f"disk-bound: the nvme tier writes and reads {gib(traffic)} per step; "
                   f"activation_tier='cpu' needs {gib(need)} of host memory instead")
    return out


def _state_saving(shape: ModelShape, have: str, other: str) -> float:
    """Host bytes of masters and state that optimizer_state `other` saves against `have`."""

    layers = state_format(have).bytes_per_param - state_format(other).bytes_per_param
    embed = embed_format(have, shape.hidden).bytes_per_param - embed_format(other, shape.hidden).bytes_per_param
    return layers * (shape.n_params - shape.embed_params) + embed * shape.embed_params
