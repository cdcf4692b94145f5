"""The sliding engine: the step and the placements it drives.

- `slide_engine`: `SlideEngine`, the services a step uses (streams, the gradient ring, the worker,
  the step norm, the store) and the forward / backward entry points.
- `schedule`: the step in one place: what runs in a layer's forward, its recompute and backward,
  and in `optimizer_step`, in order (docs/engine.md, "How a step flows").
- `placements`: where each layer's weights and state live and where it is updated (`Placements`
  assigns them); `resident`, `resident_state`, `device_update`, `late_updates`: the placements
  kept or updated on the GPU; `embedding`, `head`: the embedding and the loss head; `embedding_table`:
  where the embedding's table lives (the host store or the GPU) and how it is updated; `lm_weight`:
  where the lm_head weight lives (the head unit or a tied embedding); `end_training`: whether the
  embedding and the head train.
- `slots`, `transfer`, `staging`, `grad_ring`: the GPU slots, the streams and the copies in and out
  (`Streams`, chosen once per device: `HostStreams` or `CudaStreams`), the gradient buffers.
- `activations`, `activation_tiers`, `activation_file`: the layer inputs kept for the recompute.
- `lora`, `modules_to_save`: PEFT's adapters and trained copies inside a slid model.
- `slide_build`, `slide_checks`: what `slide()` builds and checks; `data_parallel`, `sharded`:
  several processes on one host.

May import `compute`, `host`, `disk`, `planner` (the resident sizing), `models`, and the
top-level `config` / `errors`; nothing here imports the HF integration (`trainer`, `accelerate_plugin`).
"""
