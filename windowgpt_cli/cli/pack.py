"""`windowgpt pack --out code.pyz`: the record's code as one runnable, counted archive."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..record.archive import pack
from .support import console, out_option, user_errors_exit_1


@user_errors_exit_1
def command(
    out: Annotated[Path, out_option("The zipapp to write (e.g. OUT/code.pyz).", "an archive pack wrote")],
    strip: Annotated[bool, typer.Option("--strip", help="Pack each module without its comments and docstrings "
                                        "(their lines left blank, so tracebacks keep their line numbers): about "
                                        "a third fewer bytes; the packed commands' --help then describes less.")]
    = False,
    lzma: Annotated[bool, typer.Option("--lzma", help="Put the modules into one lzma stream that the archive "
                                       "unpacks in memory when it runs: about a third fewer bytes than deflating "
                                       "each module alone.")] = False,
) -> None:
    """Pack the modules a record run imports into a zipapp that runs the record stages.

    Example: windowgpt pack --strip --lzma --out record-out/code.pyz
    """
    packed = pack(out, strip, lzma)
    console.print(f"wrote {out}: {packed.form}, {packed.bytes:,} bytes (source {packed.source_bytes:,} bytes, "
                  f"sha256 {packed.sha256[:16]}...)", highlight=False, soft_wrap=True)
