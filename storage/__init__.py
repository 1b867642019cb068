"""What is written to disk and read back:

    checkpoint.py  training checkpoints (DCP): save, manifest, verify, resume, prune; loading never runs code
    weights.py     the export at the end of a run, and load_model, which reads every layout the project writes
    hf.py          Hugging Face Qwen3 and Llama checkpoints in and out
"""
