"""Training: the loop, its checkpoints and exact resume (`trainer`), Muon and Adam over the
parameter banks with EMA and SWA (`optim`), TensorBoard and W&B sinks (`metric_sinks`),
and the train stage over a run directory (`run`).

May import: ground, storage, kernels, data, model, record, artifacts, quant, eval, generate.
"""
