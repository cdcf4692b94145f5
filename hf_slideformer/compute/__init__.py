"""What runs on the GPU inside a layer or the head, beside HF's own modules.

- `functions`: the autograd functions through which the engine's forward and backward pass.
- `layer_matmuls`, `fp8`: a layer's projections in the compute dtype or in FP8 (docs/fp8.md).
- `fused_head`: the fused linear-cross-entropy head; `tiled_mlp`: the MLP in token chunks.
- `router_aux`: a mixture of experts' auxiliary loss; `model_inputs`: the checks of the inputs.

May import `triton_ops`, `host` (the store's units) and the top-level `config` / `errors`; not
`engine` (the engine calls these, they do not call it back).
"""
