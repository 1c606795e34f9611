"""Turn a reference `final_model.pt` (a state dict saved by train_gpt_window.py) into a
windowgpt export directory, so every windowgpt stage can score or quantize the very same
weights. usage: reference_to_export.py final_model.pt OUT_DIR [TOKENIZER]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from windowgpt_cli.storage import tensorfile  # noqa: E402
from windowgpt_cli.storage.files import atomic_write_json, sha256_file  # noqa: E402
from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.model.gpt import GPT
from windowgpt_cli.model.state_dict import unbank_state_dict  # noqa: E402
from windowgpt_cli.artifacts.export import (  # noqa: E402
    EXPORT_CONFIG, EXPORT_FORMAT, EXPORT_INFO, EXPORT_VERSION, EXPORT_WEIGHTS)


def main(state_path: Path, out: Path, tokenizer: Path | None) -> None:
    cfg = RunConfig().resolved()  # the reference's defaults
    state = torch.load(state_path, map_location="cpu", weights_only=True)
    GPT(cfg.model).load_state_dict(state, strict=True)  # the shapes must be the reference's defaults
    tensors = unbank_state_dict(state, cfg.model.num_layers)
    tensorfile.save(out / EXPORT_WEIGHTS, tensors, {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION})
    atomic_write_json(out / EXPORT_CONFIG, cfg.to_dict())
    atomic_write_json(out / EXPORT_INFO, {
        "format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "weights": "reference final_model.pt",
        "source_checkpoint": str(state_path), "source_sha256": sha256_file(state_path), "step": None,
        "tokenizer_sha256": sha256_file(tokenizer) if tokenizer else None, "tensor_count": len(tensors),
        "parameter_count": sum(t.numel() for t in tensors.values()), "sha256": sha256_file(out / EXPORT_WEIGHTS),
        "config_sha256": sha256_file(out / EXPORT_CONFIG)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
