"""The reference's GPT (`gpt`): blocks, embeddings and U-Net skips over parameter banks;
the attention backends (`attention`); rotary tables (`rotary`); the seam of element-wise
steps between the products (`ops.TorchOps`) and its fused variants for scoring
(`fused_ops`), for test-time training (`fused_train_ops`) and for a training step whose
products multiply in float8 (`fp8_ops`); the names of its tensors
(`state_dict`: banks, control tensors, groups); and the grids its matrices are quantized
to, which training may round them to (`weight_grid`).

May import: ground, kernels.
"""
