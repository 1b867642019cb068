"""What is written to disk and read back:

    manifest.py      size and CRC-32 records of files, written and verified: exports, checkpoints, prepared data
    checkpoint.py    training checkpoints (DCP): save, manifest, verify, resume, prune; loading never runs code
    weights.py       the export at the end of a run, and load_model, which reads every layout the project writes
    hf.py            Hugging Face checkpoints in and out: Qwen3 and Llama, and NSA with its modeling code
    remote_code.py   the project's modules an NSA export carries, their imports made relative
    remote_model.py  the transformers classes of that export (modeling_longctx.py), around model.Transformer
"""
