"""`windowgpt export --format hf`: a folder that Hugging Face transformers loads, to share on
the Hub or use with the tools built on transformers.

FOLDER/config.json (transformers' configuration: model_type windowgpt, the classes to load
through `auto_map`, windowgpt's whole configuration under `windowgpt`), model.safetensors
(the model's tensors under `model.`, metadata `format: pt`), modeling_windowgpt.py (the
classes: `hf_modeling`), tokenizer.model when the run's tokenizer is found, and README.md.
Loading: `AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)`, with
windowgpt installed.
"""
from __future__ import annotations

import pkgutil
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ArtifactError
from ..storage import tensorfile
from ..storage.files import atomic_write_bytes, atomic_write_json, atomic_write_text, publish_dir, read_json
from .checkpoint import Checkpoint
from .export import TOKENIZER_FILE, checkpoint_to_export, copy_tokenizer

MODELING_FILE = "modeling_windowgpt.py"
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
MODEL_TYPE = "windowgpt"
PREFIX = "model."  # the transformers model holds windowgpt's model as its `model`
HF_FILES = {HF_CONFIG, HF_WEIGHTS, MODELING_FILE, TOKENIZER_FILE, "README.md"}


def export_hf(run_dir: Path, out: Path, weights: str = "ema") -> dict[str, Any]:
    """Write the transformers folder `out` from a run's chosen weights; returns its config.json."""
    ckpt = checkpoint_to_export(run_dir, out, weights, "a Hugging Face export", is_hf_dir)
    return publish_dir(Path(out), lambda folder: _write(folder, ckpt, weights))


def _write(out: Path, ckpt: Checkpoint, weights: str) -> dict[str, Any]:
    tensors = {PREFIX + name: t for name, t in ckpt.weights(weights).items()}
    tensorfile.save(out / HF_WEIGHTS, tensors, {"format": "pt"})
    atomic_write_bytes(out / MODELING_FILE, _modeling_source())
    copy_tokenizer(ckpt, out)
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["WindowGPTForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_windowgpt.WindowGPTConfig",
                     "AutoModelForCausalLM": "modeling_windowgpt.WindowGPTForCausalLM"},
        "vocab_size": ckpt.config.model.vocab_size,
        "max_position_embeddings": ckpt.config.train.train_seq_len,
        "bos_token_id": 1,
        "use_cache": False,
        "torch_dtype": "float32",
        "windowgpt": ckpt.config.to_dict(),
        "windowgpt_export": {"version": __version__, "weights": weights, "step": ckpt.step,
                             "tokenizer_sha256": ckpt.tokenizer_sha256},
    }
    atomic_write_text(out / "README.md", _model_card(ckpt, weights))
    atomic_write_json(out / HF_CONFIG, config)  # written last: its presence marks a complete folder
    return config


def _modeling_source() -> bytes:
    """hf_modeling.py, as a file or from the archive windowgpt runs from."""
    try:
        source = pkgutil.get_data(__package__, "hf_modeling.py")
    except OSError:
        source = None
    if source is None:  # the packed record code holds only the modules a record run imports
        raise ArtifactError("this windowgpt has no hf_modeling.py (the packed record code holds only the "
                            "record's modules); run export --format hf from an installed windowgpt")
    return source


def _model_card(ckpt: Checkpoint, weights: str) -> str:
    m = ckpt.config.model
    return (f"# windowgpt model\n\n{m.num_layers} layers, width {m.model_dim}, vocabulary {m.vocab_size}, "
            f"trained {ckpt.step:,} steps ({weights} weights) with windowgpt {__version__}.\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM\n\n"
            "model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)  # needs: pip install "
            "windowgpt\n```\n\nThe tokenizer is SentencePiece's tokenizer.model; every document starts with "
            "BOS (id 1).\n")


def is_hf_dir(path: Path) -> bool:
    """Whether a directory is a folder `export --format hf` wrote (and so may replace): its
    config.json names windowgpt and it holds nothing else."""
    path = Path(path)
    config = read_json(path / HF_CONFIG) or {}
    return config.get("model_type") == MODEL_TYPE and all(p.name in HF_FILES for p in path.iterdir())
