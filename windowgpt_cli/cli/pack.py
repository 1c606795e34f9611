"""`windowgpt pack --out code.pyz`: the record's code as one runnable, counted archive."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from ..record.archive import pack
from .support import console, out_option, user_errors_exit_1


@user_errors_exit_1
def command(
    out: Annotated[Path, out_option("The zipapp to write (e.g. OUT/code.pyz).", "an archive pack wrote")],
) -> None:
    """Pack the modules a record run imports into a zipapp that runs the record stages.

    Example: windowgpt pack --out record-out/code.pyz
    """
    packed = pack(out)
    console.print(f"wrote {out}: {packed.form}, {packed.bytes:,} bytes (source {packed.source_bytes:,} bytes, "
                  f"sha256 {packed.sha256[:16]}...)", highlight=False, soft_wrap=True)
