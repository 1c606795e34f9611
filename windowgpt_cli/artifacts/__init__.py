"""What a run leaves on disk, read back safely: training checkpoints and the run
directory's files (`checkpoint`), exports (`export`), `.ptz` files (`ptz`, `compressors`,
`quantized`), the weights of any of them (`weights`), where they came from (`lineage`), the
scores saved beside them (`results`), and what `inspect`, `compare` and `plot` show
(`info`, `inspect`, `compare`, `curves`).

May import: ground, storage, data, model, record.
"""
