"""Files on disk, written safely: atomic writes and directory swaps, hashes and strict
JSON (`files`), the safetensors format read without unpickling (`tensorfile`), and the lock
that gives a run directory one writer (`runlock`).

May import: ground.
"""
