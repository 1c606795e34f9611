"""A windowgpt model as a Hugging Face transformers model: the `modeling_windowgpt.py` that
`windowgpt export --format hf` copies into its folder, which
`AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)` then loads.

The folder's config.json holds windowgpt's whole configuration under `windowgpt`, and
model.safetensors the model's own tensors under `model.`: the model is windowgpt's, built
from that configuration, so its logits are windowgpt's (loading needs windowgpt installed,
`pip install windowgpt`). This file is not imported by windowgpt itself: it needs
transformers, which windowgpt does not.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class WindowGPTConfig(PretrainedConfig):
    model_type = "windowgpt"

    def __init__(self, windowgpt: dict[str, Any] | None = None, **kwargs: Any):
        self.windowgpt = windowgpt or {}
        model = self.windowgpt.get("model", {})
        # the names transformers' generic code reads; the model has no key/value cache for it
        self.num_hidden_layers = model.get("num_layers", 0)
        self.hidden_size = model.get("model_dim", 0)
        self.num_attention_heads = model.get("num_heads", 0)
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)


class WindowGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = WindowGPTConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: WindowGPTConfig):
        super().__init__(config)
        from windowgpt_cli.config import RunConfig
        from windowgpt_cli.model.gpt import GPT

        cfg = RunConfig.from_dict(config.windowgpt, source=type(config).__name__)
        self.model = GPT(cfg.model, initialize=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "WindowGPTForCausalLM":
        """transformers' loading, then the model's constants set: transformers builds the
        model on the meta device, and they are not in model.safetensors."""
        model = super().from_pretrained(*args, **kwargs)
        model.model.restore_constants()
        return model

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Every weight comes from model.safetensors."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> CausalLMOutput:
        """Logits of every position (the whole sequence recomputed: no key/value cache);
        with labels, the mean next-token loss as transformers computes it (labels shifted)."""
        logits = self.model.forward_logits(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
        return {"input_ids": input_ids}
