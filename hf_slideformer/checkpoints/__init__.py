"""Saving and loading: HF checkpoints of a slid model, training state, adapters, crash-safe writes.

- `checkpoint`: `save_pretrained` / `from_pretrained` of a slid model (HF's format).
- `train_checkpoint`: the optimizer and engine state for Trainer / Accelerate resume.
- `adapter_save`: PEFT adapters; `model_state`: the model's `state_dict` through the store;
  `atomic_save`: writes that leave the old checkpoint or the new one, never half of one.

May import `host`, `engine.slide_checks`, `models` and the top-level `config` / `errors`.
"""
