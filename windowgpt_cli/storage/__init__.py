"""Files on disk, written safely: atomic writes and directory swaps, hashes and strict
JSON (`files`), the safetensors format read without unpickling (`tensorfile`), a torch.save
file described without torch (`torchfile`), the lock that gives a run directory one
writer (`runlock`), and torch.compile's caches in one file (`compile_cache`). Torch is
imported only by the functions that make or read tensors or compiled code.

May import: ground.
"""
