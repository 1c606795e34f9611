"""Text generation: batches of samples decoded over static key/value buffers that follow
each layer's attention, one step compiled and replayed as a CUDA graph (`decoding`), and
the generate stage, which finds an artifact's tokenizer and streams its text (`text`).

May import: ground, storage, data, model, artifacts.
"""
