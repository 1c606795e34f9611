"""The command line: the Typer app (`app`), the record stages' app that the packed code runs
(`record_app`), what every command shares (`support`), and one module per stage, each a
thin edge (flags, tables, progress bars) over a plain function of the folder that owns the
stage. Modules import torch only inside commands, so that `--help` answers at once.

May import: every folder.
"""
