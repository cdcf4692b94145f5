"""The host side: the fp32 (or compact) state in host memory and the CPU thread that updates it.

- `store`: `HostStore`, each unit's master weights and optimizer state, pinned.
- `host_optim`: the host-optimizer seam (a state format declares its arrays and bytes per
  parameter and updates a range of a unit); `host_adam`: the native AdamW kernels (`csrc/`);
  `adam8_torch`: the 8-bit update in torch ops for units updated on the GPU; `quant_maps`: the
  8-bit codes; `host_rate`: the measured update rate the planner uses.
- `optim`: `SlideOptimizer`, the torch optimizer a user holds.
- `worker`, `host_tasks`: the CPU worker thread and the updates it runs.
- `memory`: host memory: pinned buffers, the checks against what the machine has.

May import `disk` (a store whose units are on disk) and the top-level `config` / `errors`;
`engine` only lazily, where the store is shared between processes.
"""
