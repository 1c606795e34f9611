"""Where `train --logger` also sends the metrics it writes to RUN/metrics.jsonl: TensorBoard
(RUN/tensorboard) or Weights & Biases (project windowgpt, files under RUN/wandb; offline
when WANDB_MODE=offline is set). Both are optional extras."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

from ..config import RunConfig
from ..errors import ConfigError

LOGGERS = ("none", "tensorboard", "wandb")


class MetricSink(Protocol):
    def log(self, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_logger(logger: str) -> None:
    """The logger's extra is installed (found, not imported): before a run starts."""
    if logger not in LOGGERS:
        raise ConfigError(f"--logger {logger!r} must be one of {', '.join(LOGGERS)}")
    if logger != "none" and importlib.util.find_spec(logger) is None:
        raise _missing_extra(logger)


def _missing_extra(extra: str) -> ConfigError:
    return ConfigError(f"--logger {extra} needs the optional extra: pip install 'windowgpt[{extra}]'")


def _import_extra(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing_extra(extra) from None


def _scalars(values: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in values.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    def __init__(self, out_dir: Path):
        _import_extra("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))

    def log(self, values: dict[str, Any]) -> None:
        for name, value in _scalars(values).items():
            self.writer.add_scalar(name, value, values.get("step"))

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, out_dir: Path, cfg: RunConfig):
        wandb = _import_extra("wandb", "wandb")
        self.run = wandb.init(project="windowgpt", name=Path(out_dir).resolve().name, dir=str(out_dir),
                              config=cfg.to_dict())

    def log(self, values: dict[str, Any]) -> None:
        self.run.log(_scalars(values), step=values.get("step"))

    def close(self) -> None:
        self.run.finish()


def open_sink(logger: str, out_dir: Path, cfg: RunConfig) -> MetricSink | None:
    check_logger(logger)
    if logger == "tensorboard":
        return TensorBoardSink(out_dir)
    if logger == "wandb":
        return WandbSink(out_dir, cfg)
    return None
