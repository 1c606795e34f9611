"""Quantization: the reference's mixed int6/int8 scheme tensor by tensor (`schemes`), GPTQ
(`gptq`), calibration Hessians from training batches (`calibration`), and the quantize
stage that writes a `.ptz` with its budget report (`quantize`).

May import: ground, storage, data, model, record, artifacts.
"""
