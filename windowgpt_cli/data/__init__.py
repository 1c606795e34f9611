"""Text to tokens and back: reading corpora (`corpus`), SentencePiece tokenizers and the
byte tables behind bits per byte (`tokenizer`, `tokenizer_meta`), the options `prepare`
may train one with (`tokenizer_options`) and its case markers (`case_ops`), the shard
format (`shards`), a data directory's manifest (`manifest`), the prepare stage and its
worker pool (`prepare`, `encoding`), and what training and scoring read (`loader`).

May import: ground, storage.
"""
