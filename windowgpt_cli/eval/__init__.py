"""Scoring: standard and sliding-window evaluation (`scoring`), score-first test-time
training by chunks (`ttt`) and with per-document LoRA adapters (`lora_ttt`), and the eval
and eval-ttt stages (`evaluate`).

May import: ground, storage, kernels, data, model, artifacts.
"""
