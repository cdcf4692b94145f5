"""The `hf-slideformer` command line: `hf-slideformer plan <model>` answers whether a model fits,
with which batch, and how fast (hf_slideformer.planner.planner). Also `python -m hf_slideformer.cli`.

Exit status: 0 when the plan fits, 1 when it does not, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from .config import SETTINGS
from .models import SUPPORTED_MODEL_TYPES
from .options import Choice
from .planner.plan_settings import ENGINE_OPTIONS
from .planner.plan_lora_targets import ALL_LINEAR, DEFAULT_TARGET_MODULES, DEFAULT_TARGET_PARAMETERS
from .planner.planner import ADAM_GPS, FROZEN_BASE_BYTES, GPU_EFFICIENCY, PEAK_FP32_TFLOPS, PEAK_HBM_GBS, PEAK_TFLOPS, plan

__all__ = ["main", "build_parser"]


def _adam_gps(text: str):
    """--adam-gps: a positive number, or 'host'."""
    if text.strip().lower() == "host":
        return "host"
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of G parameters/s or 'host', got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names, spaces and empty entries dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _lora_modules(text: str | None) -> str | tuple[str, ...]:
    """--lora-targets as PEFT's target_modules: the default, 'all-linear', or the names given."""
    if text is None:
        return DEFAULT_TARGET_MODULES
    return ALL_LINEAR if text.strip() == ALL_LINEAR else _names(text)


def _lora_parameters(text: str | None) -> tuple[str, ...]:
    """--lora-target-parameters as PEFT's target_parameters: the default, none, or the names given."""
    if text is None:
        return DEFAULT_TARGET_PARAMETERS
    return () if text.strip().lower() == "none" else _names(text)


def _engine_flag(parser: argparse.ArgumentParser, argument: str, help: str, **kw) -> None:
    """`--<argument>` for one of the engine's settings: its type, choices and default from
    SlideConfig's table (`plan_settings.ENGINE_OPTIONS`), so that the flag and the engine agree."""
    opt = SETTINGS[ENGINE_OPTIONS[argument]]
    if isinstance(opt.kind, Choice):
        kw["choices"] = opt.kind.values
    default = "none" if opt.default is None else opt.default
    parser.add_argument("--" + argument.replace("_", "-"), type=opt.kind.cli_type, default=opt.default,
                        help=f"{help} (SlideConfig.{opt.name}; default: {default})", **kw)


def _lora_flags(parser: argparse.ArgumentParser) -> None:
    """The `plan` command's flags of a PEFT LoRA run."""
    parser.add_argument("--lora-r", type=int, default=None, metavar="R",
                        help="plan a PEFT LoRA run: rank R on every linear layer of the decoder layers, the base "
                             "frozen and streamed, the adapters on the GPU (default: full fine-tuning)")
    parser.add_argument("--lora-targets", default=None, metavar="NAMES",
                        help="with --lora-r: PEFT's target_modules, comma-separated (q_proj,v_proj,...; 'all-linear'); "
                             "default: " + ",".join(DEFAULT_TARGET_MODULES))
    parser.add_argument("--lora-target-parameters", default=None, metavar="NAMES",
                        help="with --lora-r: PEFT's target_parameters, comma-separated (a mixture of experts' 3-D "
                             "weights; 'none' for none); default: " + ",".join(DEFAULT_TARGET_PARAMETERS))
    parser.add_argument("--lora-base-bytes", type=int, choices=(2, 4), default=FROZEN_BASE_BYTES,
                        help="host bytes per parameter of the frozen layers and head: 2, the compute dtype the engine "
                             "keeps them in, or 4 when the adapters are added to a model already slid (default: "
                             f"{FROZEN_BASE_BYTES})")
    parser.add_argument("--lora-modules-to-save", default="", metavar="NAMES",
                        help="with --lora-r: PEFT's modules_to_save, comma-separated among embed_tokens, lm_head "
                             "(trained in full on the host beside the adapters)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-slideformer", description="hf_slideformer: full-parameter fine-tuning "
                                     "of LLMs larger than the GPU, on one GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser(
        "plan", help="estimate memory, the largest batch and the step time of training a model",
        description="Estimate host and GPU memory, the largest batch and the step time of training a model with "
                    "hf_slideformer, from its config.json alone (model types: "
                    f"{', '.join(SUPPORTED_MODEL_TYPES)}), for full fine-tuning or, with --lora-r, a PEFT LoRA run "
                    "on a streamed frozen base. The figures are estimates calibrated on H200 measurements "
                    "(docs/planner.md).")
    plan.add_argument("model", help="a model directory holding config.json, or the path of a config.json")
    plan.add_argument("--batch", type=int, default=None,
                      help="sequences per micro-batch (default: the smallest power of two that hides AdamW behind the "
                           "GPU's compute, within memory)")
    plan.add_argument("--seq", type=int, default=None,
                      help="tokens per sequence (default: 2048, or the model's max_position_embeddings when smaller)")
    plan.add_argument("--gpu-mem", type=float, default=None, metavar="GiB",
                      help="GPU memory (default: this machine's GPU, else 24)")
    plan.add_argument("--host-mem", type=float, default=None, metavar="GiB",
                      help="host memory for training (default: MemAvailable of this machine)")
    plan.add_argument("--pcie-gbs", type=float, default=54.6,
                      help="pinned PCIe bandwidth each way, GB/s (default: 54.6)")
    plan.add_argument("--adam-gps", type=_adam_gps, default=None, metavar="G/s|host",
                      help="the host AdamW's rate alone on the training machine, G parameters/s, or 'host' to measure "
                           f"this machine's (about a second, 1 GiB of memory; default: {ADAM_GPS}, the H200 machine's)")
    plan.add_argument("--gpu-tflops", type=float, default=PEAK_TFLOPS,
                      help=f"dense bf16 peak of the GPU, TFLOPS (default: {PEAK_TFLOPS}, H100 / H200 SXM)")
    plan.add_argument("--gpu-efficiency", type=float, default=GPU_EFFICIENCY,
                      help=f"achieved share of that peak (default: {GPU_EFFICIENCY}, measured on the H200)")
    _engine_flag(plan, "gradient_accumulation_steps", "micro-batches per optimizer step", metavar="N")
    _engine_flag(plan, "max_grad_norm", "global gradient-norm clipping (> 0 adds a 4 B/param host accumulator)",
                 metavar="X")
    _engine_flag(plan, "window", "GPU layer slots")
    _engine_flag(plan, "activation_tier", "where the layer inputs wait for backward ('auto' plans 'cpu', as on CUDA)")
    _engine_flag(plan, "grad_buffers", "pinned host gradient buffers")
    _engine_flag(plan, "device_update_share", "without clipping, the share of the streamed layers updated on the GPU "
                 "in the backward instead of by the CPU", metavar="F")
    plan.add_argument("--nvme-write-gbs", type=float, default=1.2, help="disk write rate of the nvme tier, GB/s")
    plan.add_argument("--nvme-read-gbs", type=float, default=0.9, help="disk read rate of the nvme tier, GB/s")
    plan.add_argument("--nvme-gb", type=float, default=None, metavar="GB",
                      help="free space of a disk for the layers' state: what does not fit in --host-mem goes there, "
                           "the moments of the last layers first, then the whole state of the last ones "
                           "(SlideConfig.host_memory_limit; default: no disk)")
    plan.add_argument("--nvme-bw", type=float, default=7.0, metavar="GB/s",
                      help="the rate that disk reads and writes the layers' state at: 2rw/(r+w) for read rate r and "
                           "write rate w, as benchmarks/disk_bandwidth.py prints (default: 7, a PCIe 4 NVMe drive)")
    plan.add_argument("--no-resident", action="store_true",
                      help="plan without resident units (SlideConfig(resident_embedding=False, resident_layers=0))")
    _engine_flag(plan, "mlp_chunk_tokens", "the MLP in chunks of N tokens: for long sequences", metavar="N")
    _lora_flags(plan)
    plan.add_argument("--gpu-hbm-gbs", type=float, default=PEAK_HBM_GBS,
                      help=f"GPU memory bandwidth, GB/s: paces the LoRA adapters' work "
                           f"(default: {PEAK_HBM_GBS:g}, H200)")
    plan.add_argument("--gpu-fp32-tflops", type=float, default=PEAK_FP32_TFLOPS,
                      help=f"fp32 peak of the GPU, TFLOPS: the LoRA adapters' products (default: {PEAK_FP32_TFLOPS})")
    plan.add_argument("--gpus", type=int, default=1, metavar="N",
                      help="data parallelism over N GPUs of one host, one process each (torchrun): --batch is per GPU, "
                           "the host state is one shared copy; no resident units, no --nvme-gb, no --lora-r "
                           "(default: 1)")
    plan.add_argument("--optim", default=SETTINGS["optimizer_state"].default, metavar="NAME",
                      help="the host optimizer state (SlideConfig.optimizer_state): adamw (12 B/param), adamw_8bit "
                           "(8-bit moments, about 6), adamw_8bit_bf16 (and a bf16 master, about 4), or the Trainer's "
                           "adamw_torch / adamw_8bit / adamw_bnb_8bit / adamw_torch_8bit / paged_adamw_8bit "
                           "(default: adamw; docs/host_state.md)")
    plan.add_argument("--fp8", action="store_true",
                      help="the decoder layers' projections in FP8 (SlideConfig.matmuls='fp8'): their GEMMs at 1.70x "
                           "the bf16 rate measured on the H200 (docs/fp8.md)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = plan(args.model, batch=args.batch, seq=args.seq, gpu_mem=args.gpu_mem, host_mem=args.host_mem,
                      pcie_gbs=args.pcie_gbs, adam_gps=args.adam_gps, gpu_tflops=args.gpu_tflops,
                      gpu_efficiency=args.gpu_efficiency, gradient_accumulation_steps=args.gradient_accumulation_steps,
                      max_grad_norm=args.max_grad_norm, window=args.window, activation_tier=args.activation_tier,
                      grad_buffers=args.grad_buffers, nvme_write_gbs=args.nvme_write_gbs,
                      nvme_read_gbs=args.nvme_read_gbs, resident=not args.no_resident, nvme_gb=args.nvme_gb,
                      nvme_bw=args.nvme_bw, lora_r=args.lora_r, lora_base_bytes=args.lora_base_bytes,
                      lora_modules_to_save=_names(args.lora_modules_to_save),
                      lora_target_modules=_lora_modules(args.lora_targets),
                      lora_target_parameters=_lora_parameters(args.lora_target_parameters),
                      mlp_chunk_tokens=args.mlp_chunk_tokens,
                      gpu_hbm_gbs=args.gpu_hbm_gbs, gpu_fp32_tflops=args.gpu_fp32_tflops, gpus=args.gpus,
                      optim=args.optim, fp8=args.fp8, device_update_share=args.device_update_share)
    except (OSError, ValueError) as e:
        print(f"hf-slideformer plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.report())
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
