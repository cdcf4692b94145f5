"""`hs.plan` / `hf-slideformer plan`: what fits and how fast, before anything is loaded.

- `planner`: `plan()` and `Plan`; `plan_shape`: a model's shape from its config;
  `plan_estimate`: the step's time terms (GPU, PCIe, host AdamW, disk); `plan_report`: the text;
  `plan_advice`: what to change, from the plan's shortfalls and its binding term;
  `plan_lora`: LoRA's terms; `plan_lora_targets`: what a LoRA run adapts, counted as PEFT
  does; `plan_calibration`: measured rates; `budget`: the GPU memory terms, also used by the
  engine to size what stays resident.

May import `host` (state formats, rates, `memory`), `disk` (the split), `engine.resident_state`
and `models`; never the engine's step.
"""
