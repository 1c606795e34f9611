"""Triton kernels: the window attention with sink tokens, forward and backward
(`window_attention`), the fused element-wise steps of scoring (`elementwise`), the
backward kernels of test-time training's fused steps (`elementwise_backward`), the
soft-capped cross-entropy of training (`cross_entropy`) and the training step's MLP with
LeakyReLU² in its products' epilogues (`fused_mlp`), each with the functions that
launch it on plain tensors; FlashAttention-4's attention as torch custom ops (`flash4`,
the `fa4` extra), the sink tokens beside its window folded in by kernels of their own
(`attention_sinks`); those epilogue products through quack's CuTe GEMMs, LeakyReLU² one of
its activations (`quack_products`, quack-kernels, which the `fa4` extra installs); the
training step's products in float8 through cuBLAS (`fp8_products`, plain torch) and its
MLP in float8 with LeakyReLU² and the rounding of its rows in one kernel each way
(`fp8_mlp`); the queries' and keys' per-head norm, rotation and gain (`fused_heads`) and
XSA with the output gate (`attention_output`) as the training step's custom ops. Nothing
here knows the model. Importing a Triton kernel's module imports Triton: they are imported
only where a GPU path runs.

May import: ground.
"""
