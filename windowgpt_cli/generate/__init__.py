"""Text generation: incremental decoding with key/value caches that follow each layer's
attention (`decoding`), and the generate stage (`text`).

May import: ground, storage, data, model, artifacts.
"""
