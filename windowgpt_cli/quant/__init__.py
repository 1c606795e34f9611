"""Quantization: the reference's mixed int6/int8 scheme tensor by tensor and the settings
that depart from it (`schemes`), GPTQ (`gptq`), LQER's low-rank corrections (`lqer`),
calibration Hessians from training batches (`calibration`), and the quantize stage that
writes a `.ptz` with its budget report (`quantize`).

May import: ground, storage, data, model, record, artifacts.
"""
