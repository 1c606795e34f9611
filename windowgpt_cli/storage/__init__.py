"""Files on disk, written safely: atomic writes and directory swaps, hashes and strict
JSON (`files`), the safetensors format read without unpickling (`tensorfile`), a torch.save
file described without torch (`torchfile`), and the lock that gives a run directory one
writer (`runlock`). Torch is imported only by the functions that make or read tensors.

May import: ground.
"""
