"""The model's tensors by name: the parameter banks and the per-layer names the reference
uses (`unbank_state_dict`, `rebank_state_dict`), the control tensors kept exact, and the
categories quantization and reports sort tensors into."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names alone need no torch (commands that only describe a run)
    from torch import Tensor

# Control tensors stay float32 and go to the scalar optimizer; quantization keeps them exact.
CONTROL_TENSOR_NAME_PATTERNS = (
    "attn_scale", "attn_scales", "mlp_scale", "mlp_scales", "resid_mix", "resid_mixes", "q_gain",
    "skip_weight", "skip_weights", "smear", "dtg_gate", "ve_layer_scales", "ve_shared.scale",
    "attn_gate", "vr_lambda", "skip_gates", "lane_mix",
)
BANK_NAMES = ("qo_bank", "kv_bank", "mlp_up_bank", "mlp_down_bank")


def is_control_tensor(name: str) -> bool:
    return any(pattern in name for pattern in CONTROL_TENSOR_NAME_PATTERNS)


def bank_slots(n: int) -> dict[str, list[tuple[int, str]]]:
    """For each bank, which per-layer weight name fills which slot."""
    return {
        "qo_bank": [(i, f"blocks.{i}.attn.c_q.weight") for i in range(n)]
        + [(n + i, f"blocks.{i}.attn.proj.weight") for i in range(n)],
        "kv_bank": [(i, f"blocks.{i}.attn.c_k.weight") for i in range(n)]
        + [(n + i, f"blocks.{i}.attn.c_v.weight") for i in range(n)],
        "mlp_up_bank": [(i, f"blocks.{i}.mlp.fc.weight") for i in range(n)],
        "mlp_down_bank": [(i, f"blocks.{i}.mlp.proj.weight") for i in range(n)],
    }


def unbank_state_dict(sd: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Split the 3-D banks into per-layer 2-D tensors with the reference's names."""
    slots = bank_slots(num_layers)
    out: dict[str, Tensor] = {}
    for name, tensor in sd.items():
        if name in slots:
            out.update({layer_name: tensor[slot] for slot, layer_name in slots[name]})
        else:
            out[name] = tensor
    return out


def rebank_state_dict(sd: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Inverse of unbank_state_dict."""
    import torch

    slots = bank_slots(num_layers)
    consumed = {layer_name for bank in slots.values() for _, layer_name in bank}
    out = {name: t for name, t in sd.items() if name not in consumed}
    for bank, entries in slots.items():
        ordered = sorted(entries)
        out[bank] = torch.stack([sd[layer_name] for _, layer_name in ordered])
    return out


# The groups reports and `inspect` sort tensors into; quantization's categories, plus control.
GROUPS = ("attn", "mlp", "embed", "other", "control")


def classify_param(name: str) -> str:
    """The reference's tensor categories: embed, mlp, attn or other.

    Like the reference, any ".proj." outside an MLP counts as attention (so a large
    BigramHash or value-embedding projection would be int6).
    """
    if "tok_emb" in name or "lm_head" in name:
        return "embed"
    if ".mlp." in name:
        return "mlp"
    if ".attn." in name or ".proj." in name:
        return "attn"
    return "other"


def tensor_group(name: str) -> str:
    return "control" if is_control_tensor(name) else classify_param(name)
