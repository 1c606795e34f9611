"""What a run leaves on disk, read back safely: training checkpoints and the run directory's
files (`checkpoint`), exports (`export`), `.ptz` files (`ptz`, `compressors`, `codecs`,
`grouped`, `quantized`), which of them a path names (`kinds`), the weights of any of them
(`weights`), where they came from (`lineage`), the scores saved beside them (`results`),
what `inspect`, `compare`, `plot` and `report` show (`info`, `inspect`, `compare`, `curves`,
`report_card`: read without torch), and the folder Hugging Face transformers loads (`hf`,
with the code it runs, `hf_modeling`).

May import: ground, storage, data, model, record.
"""
