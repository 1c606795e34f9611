"""What a path given as an artifact names: a run, an export or a `.ptz` (`locate_artifact`),
the one rule the stages that read weights and the commands that describe artifacts share."""
from __future__ import annotations

from pathlib import Path

from ..errors import ArtifactError
from .checkpoint import FILENAME as CHECKPOINT_FILENAME
from .export import EXPORT_WEIGHTS

RUN, EXPORT, PTZ = "run", "export", "ptz"


def locate_artifact(path: Path) -> tuple[str, Path]:
    """(kind, where): (RUN, the run directory) for a run directory or its checkpoint.pt,
    (EXPORT, the export directory) for an export directory or its model.safetensors, (PTZ,
    the file) for any other file; ArtifactError for a directory that is neither, or a path
    that does not exist."""
    path = Path(path)
    if path.is_dir():
        if (path / CHECKPOINT_FILENAME).is_file():
            return RUN, path
        if (path / EXPORT_WEIGHTS).is_file():
            return EXPORT, path
        raise ArtifactError(f"{path}: neither a run directory ({CHECKPOINT_FILENAME}) "
                            f"nor an export directory ({EXPORT_WEIGHTS})")
    if not path.exists():
        raise ArtifactError(f"{path}: no such file or directory")
    if path.name == CHECKPOINT_FILENAME:
        return RUN, path.parent
    if path.name == EXPORT_WEIGHTS:
        return EXPORT, path.parent
    return PTZ, path
