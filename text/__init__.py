"""Text in, tokens out:

    corpus.py     input files -> documents (text, JSONL, parquet, prompt/response); the default corpus
    tokenizer.py  the project's SentencePiece BPE and released models' tokenizer.json
    shards.py     token shards on disk, the validation split, the resumable loader
    synthetic.py  retrieval documents: passkey, needle, MQAR, copying
"""
