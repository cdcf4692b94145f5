"""The planner's performance model: the formulas for host and GPU memory, PCIe traffic and the
step time's terms, for a model's shape (plan_shape.py) and the calibrated constants
(plan_calibration.py), both re-exported here.

The estimate follows the engine's allocations (slide_engine.py, store.py, activations.py) and the step-time
bound of docs/benchmarks.md ("Protocol and columns"); its free constants are calibrated on the Llama-3.2-3B and
-3.1-8B shapes on an H200 (docs/planner.md). Nothing here touches a GPU or builds a model.
`planner.plan` applies these formulas to one setting; `plan_report` turns the result into text.
"""
from __future__ import annotations

from dataclasses import dataclass

from .budget import balanced_share, device_piece
from ..disk.disk_plan import DiskSplit
from ..host.host_optim import embed_format, state_format
from ..host.memory import COPY_CHUNK
from .plan_calibration import (  # noqa: F401 - the calibration, importable from here as well
    PEAK_TFLOPS, GPU_EFFICIENCY, ACT_HIDDEN, ACT_INTER, PROCESS_HOST_BYTES, NVME_BUFFERS, GRAD_BYTES,
    GPU_USABLE, GPU_CONTEXT_BYTES, DUPLEX, ADD_VS_ADAM, ADAM_GPS, FP8_GEMM_SPEEDUP, FP8_QUANT_HBM_SHARE, ENGINE_EFFICIENCY,
    FORWARD_SHARE, DEVICE_UPDATE_LINK, RESERVED_VS_ALLOCATED, LINEAR_ATTENTION_S_PER_TOKEN, ACT_LINEAR,
)
from .plan_shape import ModelShape, load_model_config, model_shape

__all__ = ["FP8_GEMM_SPEEDUP", "ModelShape", "Estimator", "load_model_config", "model_shape", "gpu_binds", "batch_limit"]

@dataclass(frozen=True)
class Estimator:
    """The formulas, for one model, sequence length, window and set of rates (docs/planner.md)."""

    s: ModelShape
    seq: int
    window: int
    grad_buffers: int
    rates: dict
    mlp_chunk: int | None = None      # SlideConfig.mlp_chunk_tokens
    gpus: int = 1                     # data-parallel processes of one host, one GPU each (data_parallel.py)
    optimizer_state: str = "adamw"    # SlideConfig.optimizer_state: the host bytes per parameter (host_optim.py)
    fp8: bool = False                 # SlideConfig.matmuls='fp8': the layers' projection GEMMs at FP8_GEMM_SPEEDUP
    device_share: float = 0.0         # of the streamed layers, updated on the GPU in the backward (device_update.py)

    @property
    def state_key(self) -> str:
        """The host item of the masters and AdamW state."""
        if self.optimizer_state == "adamw":
            return "fp32 masters + Adam m, v (12 B/param)"
        bpp = state_format(self.optimizer_state).bytes_per_param
        ebpp = embed_format(self.optimizer_state, self.s.hidden).bytes_per_param
        embed = "" if ebpp == bpp else f", the embedding's {ebpp:.0f}"
        return f"masters + AdamW state ({self.optimizer_state}: {bpp:.2f} B/param{embed})"

    def state_bytes(self, layers_on_disk: int = 0) -> int:
        """Host bytes of the masters and AdamW state of the units in host memory (the embedding's
        in its own format, `host_optim.embed_format`: the units' where its rows are whole blocks)."""
        shape = self.s
        bpp = state_format(self.optimizer_state).bytes_per_param
        held = shape.n_params - layers_on_disk * shape.layer_params
        ebpp = embed_format(self.optimizer_state, shape.hidden).bytes_per_param
        return int(bpp * (held - shape.embed_params)) + int(ebpp * shape.embed_params)

    def master_bytes(self) -> tuple[int, int]:
        """Bytes per parameter of the masters the slots copy in: (layers' and head's, the embedding's)."""
        return (state_format(self.optimizer_state).master_dtype.itemsize,
                embed_format(self.optimizer_state, self.s.hidden).master_dtype.itemsize)

    def inter_tokens(self, T: int) -> int:
        """Tokens whose MLP intermediates are alive at once in a layer's recompute + backward."""
        return min(T, self.mlp_chunk) if self.mlp_chunk else T

    def chunk_flops(self, T: int) -> float:
        """FLOPs per token the chunked MLP adds: its backward recomputes each chunk's forward."""
        return 6 * self.s.hidden * self.s.intermediate * self.s.layers if self.inter_tokens(T) < T else 0.0

    host_updates = True      # the CPU updates the host store's units: resident units and clipping's wait apply

    def per_gpu(self, name: str) -> str:
        """A host item's name, marked as counted once per GPU's process when there are several."""
        return name if self.gpus == 1 else f"{name} x {self.gpus} GPUs"

    def shard(self, numel: int) -> int:
        """Elements of one rank's shard of a unit of `numel` (data_parallel.DataParallel.per_rank)."""
        return -(-numel // self.gpus)

    def accumulator_bytes(self) -> int:
        """Host bytes of the fp32 gradient accumulators of accumulation or clipping: the embedding excluded
        with one process (its gradient is the engine's), included with several (one copy of all shards)."""
        shape = self.s
        return 4 * (shape.n_params - (shape.embed_params if self.gpus == 1 else 0))

    def host(self, B: int, tier: str, deferred: bool, disk_layers: DiskSplit = DiskSplit()) -> dict:
        """Host bytes by item; `disk_layers`: the last layers with their moments, or their whole
        state, on disk (host_memory_limit)."""
        shape, tok_h = self.s, B * self.seq * self.s.hidden
        # Pinned buffers count their exact size: the engine registers what it allocates
        # (memory.pin_slab), without the caching host allocator's power-of-two rounding.
        acts = self.layer_inputs_host(B, tier)
        out = {self.state_key: self.state_bytes(disk_layers.layers)}
        out.update(disk_layers.host_items(shape.layer_params, state_format(self.optimizer_state)))
        if self.gpus > 1:
            return self._host_data_parallel(out, tok_h, acts, tier, deferred)
        head = shape.head_params + (shape.embed_params if shape.tied and deferred else 0)
        late = 0 if disk_layers.layers or disk_layers.moments else self.late_layers(deferred)
        if deferred:
            out["fp32 gradient accumulator (4 B/param, embedding excluded)"] = 4 * (shape.n_params - shape.embed_params)
        if shape.tied or deferred:     # an untied one with one backward per step reads as zeros, unbacked
            # [Why only a tied embedding's dense gradient is pinned]
            out[f"embedding gradient (fp32{', pinned' if shape.tied else ''})"] = 4 * shape.embed_params
        out.update({
            f"gradient ring ({self.grad_buffers} x largest layer, bf16)":
                GRAD_BYTES * self.grad_buffers * shape.layer_params,
            # an untied head updated in backward keeps its own until the backward ends (engine: [Why an
            # untied head is updated when the backward ends]); else borrowed from the ring when it fits
            # there ([Why the head's gradient borrows the ring]); a tied lm_head's gradient joins it
            # with accumulation only
            "head host buffer (bf16, pinned)": (GRAD_BYTES * head if not shape.tied and not deferred
                                                else 0 if head <= self.grad_buffers * shape.layer_params
                                                else GRAD_BYTES * head),
            # embedding.py: the forward's gather in bf16 (the native kernel; fp32 without it), the
            # backward's row sums in fp32
            "embedding row buffers (B*S*H bf16 + fp32, pinned)": (2 + 4) * tok_h,
            # updates in backward: the top layers' gradients wait for the backward's end (engine:
            # [Why the top layers are updated late]), about the embedding's size in layers
            f"late layers' gradients ({late} x largest layer, bf16, pinned)": GRAD_BYTES * late * shape.layer_params,
            f"layer inputs ({tier} tier)": acts,
            "process (torch, CUDA runtime, Python)": PROCESS_HOST_BYTES,
        })
        return out

    def late_layers(self, deferred: bool) -> int:
        """Layers whose update waits for the end of the backward (late_updates.py): with updates in
        backward (and no layer on disk), enough to cover the embedding's whole-table update."""
        return 0 if deferred else min(self.s.layers, -(-self.s.embed_params // self.s.layer_params))

    def _host_data_parallel(self, out: dict, tok_h: int, acts: int, tier: str, deferred: bool) -> dict:
        """The host items of several processes (data_parallel.py, sharded.py): the state (masters,
        moments, accumulators) once, in memory the ranks share; each rank's shard buffers of the
        embedding's and the head's gradients (1/N of each, one copy in total: a tied lm_head's gradient
        joins the embedding's); the ring, row buffers, layer inputs and process once per rank."""
        shape, gpus = self.s, self.gpus
        if deferred:
            out[f"fp32 gradient accumulators (4 B/param, each GPU writes its 1/{gpus}: one copy)"] = \
                self.accumulator_bytes()
        out.update({
            f"embedding gradient shards (fp32, pinned, 1/{gpus} on each GPU: one copy)":
                4 * gpus * self.shard(shape.embed_params),
            self.per_gpu(f"gradient ring ({self.grad_buffers} x largest layer, bf16)"):
                gpus * GRAD_BYTES * self.grad_buffers * shape.layer_params,
            f"head gradient shards (bf16, pinned, 1/{gpus} on each GPU: one copy)":
                gpus * GRAD_BYTES * self.shard(shape.head_params),
            self.per_gpu("embedding row buffers (B*S*H bf16 + fp32, pinned)"): gpus * (2 + 4) * tok_h,
            self.per_gpu(f"layer inputs ({tier} tier)"): gpus * acts,
            self.per_gpu("process (torch, CUDA runtime, Python)"): gpus * PROCESS_HOST_BYTES,
        })
        return out

    def layer_inputs_host(self, B: int, tier: str) -> int:
        """Host bytes of the layer inputs kept for backward on `tier` (bf16)."""
        tok_h = B * self.seq * self.s.hidden
        # the last layer's input stays on the device (activations.py); nvme: the I/O thread's bounce buffers
        return {"cpu": (self.s.layers - 1) * 2 * tok_h, "device": 0, "nvme": NVME_BUFFERS * 2 * tok_h}[tier]

    def logits_rows(self, T: int) -> int:
        """Rows of the fused loss's logits chunk for T tokens (triton_ops' default_chunk_tokens: a
        (C, V) bf16 buffer of max(T*H, V*H/8) elements, >= 32 MiB)."""
        shape = self.s
        rows = max(2 * max(T * shape.hidden, shape.vocab * shape.hidden // 8), 32 << 20) // (2 * shape.vocab)
        return min(T, max(64, rows // 64 * 64) if rows >= 64 else max(1, rows))

    def gpu(self, B: int, tier: str) -> tuple[dict, dict]:
        """(bytes held all step, bytes of each phase); the peak is the first plus the larger phase."""
        shape, T = self.s, B * self.seq
        H, head = shape.hidden, shape.head_slot_params
        fixed = {
            f"layer slots ({self.window} x largest layer, bf16)": 2 * self.window * shape.layer_params,
            "fp32 staging (h2d + d2h chunks)": 2 * 4 * min(max(shape.layer_params, head), COPY_CHUNK),
            "head slot (bf16)": 2 * head,
        }
        if self.fp8:      # the recomputed layer's forward forms, one at a time its dgrad forms (layer_matmuls.py)
            fixed["FP8 weights (largest layer, e4m3)"] = shape.layer_params
        if tier == "device":
            fixed["layer inputs (device tier)"] = 2 * shape.layers * T * H
        if self.gpus > 1:
            # sharded.py: a layer's gradient copied into a flat buffer and reduce-scattered into a
            # shard; a tied lm_head's gradient kept from the head's backward to the embedding's
            fixed[f"reduce-scatter buffers (one layer's gradient + its 1/{self.gpus} shard, bf16)"] = \
                GRAD_BYTES * (self.gpus * self.shard(shape.layer_params) + self.shard(shape.layer_params))
            if shape.tied:
                fixed["tied lm_head gradient, kept for the embedding's reduce-scatter (bf16)"] = 2 * shape.embed_params
        rows = self.logits_rows(T)
        phases = {
            # transfer.py: [Why copy sources are handed over, not recorded]: the gradient copied out
            # before a layer's backward is held until the next hand-over, the head's (the larger)
            # through the top layer's
            f"layer recompute + backward (B*S*{ACT_HIDDEN} H + {ACT_INTER} I x "
            f"{'the MLP chunk' if self.inter_tokens(T) < T else 'B*S'}, bf16), the head's gradient still crossing":
                2 * T * ACT_HIDDEN * H + 2 * self.inter_tokens(T) * ACT_INTER * shape.intermediate
                + GRAD_BYTES * max(head, shape.layer_params),
            # hidden states: the head's input, its gradient and the norm's output (bf16), the fp32
            # loss-gradient rows, and the last layer's input, kept for its backward
            # (with several processes a tied lm_head's gradient is in the fixed part)
            "head: gradient (bf16), logits chunk, hidden states":
                2 * (head - (shape.embed_params if self.gpus > 1 and shape.tied else 0)) + 2 * rows * shape.vocab
                + T * (8 * H + 4),
        }
        if self.fp8:
            # fp8.SharedInputs: a projection input's transposed e4m3 form lives until its last
            # reader's backward, beside one output gradient's form: at most the activation's and
            # the MLP input's, or a gate / up gradient's and the MLP input's
            key = next(k for k in phases if k.startswith("layer recompute"))
            phases[key + "; FP8 forms of a gradient and an input (I + H, e4m3)"] = \
                phases.pop(key) + T * (H + shape.intermediate)
        if shape.linear_attention_layers:       # the chunked gated delta rule's fp32 tensors
            key = next(k for k in phases if k.startswith("layer recompute"))
            phases[key + f"; a linear-attention layer's {ACT_LINEAR} fp32 value-width tensors"] = \
                phases.pop(key) + 4 * T * ACT_LINEAR * shape.linear_width
        if self.gpus > 1:
            # sharded.ShardedEmbedding.backward: the rows' fp32 gradients summed per distinct row,
            # scattered into a dense fp32 gradient (a tied lm_head's added, widened), reduce-scattered
            dense = 4 * self.gpus * self.shard(shape.embed_params)
            phases[f"embedding backward: dense fp32 gradient + its 1/{self.gpus} shard, the rows' fp32 gradients"] = \
                dense + 4 * self.shard(shape.embed_params) + 2 * 4 * T * H \
                + (4 * shape.embed_params if shape.tied else 0)
        return fixed, phases

    def gpu_extras(self, N: int, clipping: bool) -> dict:
        """Device buffers: one layer's fp32 running sum with accumulation (accumulate.py), two sets of fp32
        pieces with clipping or a share in the backward, and with that share a device layer's
        gradients kept one layer longer (device_update.py)."""
        out = {}
        if self.gpus > 1:           # several processes: no device accumulation, no device updates (sharded.py)
            return out
        if N > 1:
            out["accumulation buffer (fp32, one layer)"] = 4 * self.s.layer_params
        if clipping or self.device_share:     # two sets of up to two pieces (budget.device_piece)
            out["device-update buffers (2 x 4 fp32 pieces)"] = 32 * min(2 * device_piece(self.s.layer_params), self.s.layer_params)
        if self.device_share and not clipping:      # [Why an update in the backward has streams of its own]
            out["device layer's gradients, held a layer longer"] = GRAD_BYTES * self.s.layer_params
        return out

    def gpu_peak(self, B: int, tier: str) -> int:
        fixed, phases = self.gpu(B, tier)
        return sum(fixed.values()) + max(phases.values())

    def flops_per_token(self, recompute: bool = True) -> float:
        """Matmul FLOPs per token: layers 6 N (fwd, bwd) plus the recompute's 2 N less down_proj's
        2 I H (its product is not recomputed), head 6 V H, causal attention (forward 2 S d per
        layer of softmax attention, backward 2.5 x the forward). N counts the parameters a token
        computes with: a mixture of experts' top-k experts (`active_layer_params`), whose recompute
        skips nothing; the host and PCIe terms count every parameter. A linear-attention layer's
        own work is timed, not counted (`linear_attention_seconds`)."""
        shape = self.s
        softmax_layers = shape.layers - shape.linear_attention_layers
        attn = (9 if recompute else 7) * self.seq * shape.heads * shape.head_dim * softmax_layers
        return self.projection_flops(recompute) + 6 * shape.vocab * shape.hidden + attn

    def projection_flops(self, recompute: bool = True) -> float:
        """The decoder layers' projection FLOPs per token (the GEMMs the FP8 mode runs in FP8)."""
        shape = self.s
        compute_params = shape.compute_layer_params
        return shape.layers * (6 * compute_params
                               + (2 * (compute_params - shape.skipped_product_params) if recompute else 0))

    def gpu_seconds(self, B: int, N: int, recompute: bool = True) -> float:
        """The GPU's compute per optimizer step of N micro-batches (without the recompute: the
        GPU-resident time, the benchmark's compute bound)."""
        rates = self.rates
        T = B * self.seq
        flops = self.flops_per_token(recompute) + (self.chunk_flops(T) if recompute else 0.0)
        quant = 0.0
        if self.fp8:      # bf16-equivalent FLOPs: the projections' GEMMs run FP8_GEMM_SPEEDUP times faster
            flops -= self.projection_flops(recompute) * (1 - 1 / FP8_GEMM_SPEEDUP)
            quant = self.fp8_quant_bytes(T) / (rates["gpu_hbm_gbs"] * 1e9 * FP8_QUANT_HBM_SHARE)
        return N * (T * flops / (rates["gpu_tflops"] * 1e12 * rates["gpu_efficiency"]) + quant
                    + self.linear_attention_seconds(T, recompute))

    def linear_attention_seconds(self, T: int, recompute: bool = True) -> float:
        """GPU seconds of the linear-attention layers' work beyond their projections for a
        micro-batch of T tokens (the measured `LINEAR_ATTENTION_S_PER_TOKEN`; without the
        recompute, less its forward share)."""
        share = 1.0 if recompute else 1.0 - FORWARD_SHARE
        return self.s.linear_attention_layers * T * LINEAR_ATTENTION_S_PER_TOKEN * share

    def fp8_quant_bytes(self, T: int) -> float:
        """Bytes of the FP8 quantization passes per micro-batch of T tokens (docs/fp8.md, "Fused
        quantization"), per layer: 6 per element of the output gradients, 5 of the inputs'
        transposed forms, 6 of the attention output's rows, 9 per weight parameter."""
        shape = self.s
        q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        # the outputs of q, k, v, o, gate, up, down; the inputs of q/k/v, o, gate/up, down
        outputs = q_dim + 2 * kv_dim + shape.hidden + 2 * shape.intermediate + shape.hidden
        inputs = shape.hidden + q_dim + shape.hidden + shape.intermediate
        return shape.layers * (T * (6 * outputs + 5 * inputs + 6 * q_dim) + 9 * shape.compute_layer_params)

    def traffic(self, B: int, N: int, tier: str, res: tuple[bool, int] = (False, 0)) -> tuple[int, int]:
        """Bytes host-to-device and device-to-host per optimizer step of N micro-batches
        (res: resident embedding?, resident layers)."""
        shape, TH, (mb, eb) = self.s, B * self.seq * self.s.hidden, self.master_bytes()
        if self.gpus > 1:
            return self._traffic_data_parallel(B, N, tier)
        embed_res, resident_layers = res
        sent = shape.layers - resident_layers
        layers = sent * shape.layer_params
        # the last layer's input stays on the device, the first is gathered again from a resident embedding
        acts = 2 * max(0, shape.layers - 1 - embed_res) * TH if tier in ("cpu", "nvme") else 0
        resent = max(0, sent - self.window) * shape.layer_params   # the last `window` layers stay for backward
        head = shape.head_slot_params - (shape.embed_params if embed_res and shape.tied else 0)
        rows = 0 if embed_res else 4 * TH
        # masters, rows
        h2d = mb * (layers + resent + shape.head_params) + eb * (head - shape.head_params) + rows + acts
        # gradients of the units updated on the host (resident ones stay): in the compute dtype
        # into the ring with one micro-batch, fp32 sums into the accumulators with several
        # (engine: [Why gradients cross in the compute dtype]); embedding rows
        d2h = (GRAD_BYTES if N == 1 else 4) * (sent * shape.layer_params + head) + rows + acts
        if self.device_share:
            # a device-updated layer's master and state go in and back instead of its gradient out
            state = self.device_share * layers * state_format(self.optimizer_state).bytes_per_param
            h2d, d2h = h2d + state, d2h + state - self.device_share * layers * GRAD_BYTES
        # With accumulation each later micro-batch brings the layers' running sums back in (accumulate.py).
        return int(N * h2d + (N - 1) * 4 * layers), int(N * d2h)

    def _traffic_data_parallel(self, B: int, N: int, tier: str) -> tuple[int, int]:
        """One rank's bytes each way per optimizer step of several processes (no resident units):
        the same h2d as one process's, without the accumulation's running sums (each micro-batch's
        shard is added on the host); out, this rank's shard of every unit's gradient, reduced on the
        devices, for every micro-batch: the layers' and the head's in the compute dtype, the
        embedding's dense in fp32 (sharded.py), and its own layer inputs."""
        shape, TH, (mb, eb) = self.s, B * self.seq * self.s.hidden, self.master_bytes()
        layers = shape.layers * shape.layer_params
        acts = 2 * max(0, shape.layers - 1) * TH if tier in ("cpu", "nvme") else 0
        resent = max(0, shape.layers - self.window) * shape.layer_params
        h2d = (mb * (layers + resent + shape.head_params) + (eb * shape.embed_params if shape.tied else 0)
               + 4 * TH + acts)
        grads = (GRAD_BYTES * (shape.layers * self.shard(shape.layer_params) + self.shard(shape.head_params))
                 + 4 * self.shard(shape.embed_params))
        return N * h2d, N * (grads + acts)

    def resident_params(self, res: tuple[bool, int]) -> int:
        return (self.s.embed_params if res[0] else 0) + res[1] * self.s.layer_params

    def disk_state_bytes(self, disk_layers: DiskSplit) -> int:
        """Bytes of the state file of the layers on disk (`DiskSplit.file_bytes`)."""
        return disk_layers.file_bytes(self.s.layer_params, state_format(self.optimizer_state))

    def disk_traffic(self, N: int, disk_layers: DiskSplit, deferred: bool | None = None) -> int:
        """Bytes the layers on disk read and write per optimizer step of N micro-batches
        (`DiskSplit.traffic`; deferred: default N > 1)."""
        deferred = N > 1 if deferred is None else deferred
        return disk_layers.traffic(self.s.layer_params, state_format(self.optimizer_state), N, deferred)

    def times(self, B: int, N: int, tier: str, deferred: bool | None = None,
              res: tuple[bool, int] = (False, 0), disk_layers: DiskSplit = DiskSplit()) -> dict:
        """Seconds per optimizer step of each term of the bound (deferred: default N > 1)."""
        deferred = N > 1 if deferred is None else deferred
        rates, shape = self.rates, self.s
        h2d, d2h = self.traffic(B, N, tier, res)
        bw, adam = rates["pcie_gbs"] * 1e9, rates["adam_gps"] * 1e9
        on_cpu = shape.n_params - self.resident_params(res)
        layers_on_cpu = on_cpu - (0 if res[0] else shape.embed_params)
        if self.gpus > 1:
            # One host's AdamW over every parameter, the ranks' workers sharing its cores and memory;
            # deferred, every micro-batch's shards are copied (first) or added into the accumulators.
            cpu = shape.n_params / adam + (N * shape.n_params if deferred else 0) / (adam * ADD_VS_ADAM)
        else:
            # deferred mode: each micro-batch's gradients are copied (first) or added into the host
            # accumulator; with accumulation the GPU adds the layers' (accumulate.py), with clipping
            # alone the device-updated layers' land there directly (device_update.py)
            on_gpu = self.device_share * (shape.layers - res[1]) * shape.layer_params     # device_update.py
            cpu = (on_cpu - on_gpu) / adam + (N * (on_cpu - layers_on_cpu) if N > 1 else
                                   (1 - balanced_share()) * layers_on_cpu if deferred else 0) / (adam * ADD_VS_ADAM)
        out = {
            "gpu": self.gpu_seconds(B, N),
            "pcie": max(h2d / bw, d2h / bw, (h2d + d2h) / (2 * DUPLEX * bw)),
            "cpu": cpu,
        }
        if tier == "nvme":          # several processes: their layer inputs share the one disk
            acts = self.gpus * N * 2 * shape.layers * B * self.seq * shape.hidden
            out["disk"] = acts / (rates["nvme_write_gbs"] * 1e9) + acts / (rates["nvme_read_gbs"] * 1e9)
        if disk_layers.layers:       # the layers' state shares the disk with the nvme tier's inputs
            out["disk"] = out.get("disk", 0.0) + self.disk_traffic(N, disk_layers, deferred) / (rates["nvme_bw"] * 1e9)
        return out

    def hiding_batch(self, N: int, tier: str, limit: int, deferred: bool | None = None, disk_of=None) -> int:
        """Smallest power-of-two batch whose GPU term is the largest, capped at `limit` (0 if < 1);
        `disk_of(batch)`: the layers on disk at that batch (none by default)."""
        batch = 1
        while batch < limit:
            if gpu_binds(self.times(batch, N, tier, deferred, disk_layers=disk_of(batch) if disk_of else DiskSplit())):
                return batch
            batch *= 2
        return max(0, limit)


def gpu_binds(times: dict) -> bool:
    """Whether the GPU's term is the largest of a step's `times` (the other terms hide behind it)."""
    return times["gpu"] >= max(times.values())


def batch_limit(max_gpu: int, max_host: int | None) -> int:
    """The largest batch to consider: both memories', or the GPU's when the host cannot fit even batch 1."""
    return max_gpu if not max_host else min(max_gpu, max_host)
