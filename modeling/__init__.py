"""The model's parts (model.py assembles them):

    config.py     ModelConfig (what the weights mean), ComputeConfig (how a forward runs), presets, the attention
                  registry
    attention.py  the AttentionLayer protocol every attention type implements, and full attention (SDPA)
    layers.py     RMSNorm, rotary embeddings (RoPE, YaRN, Llama 3 scaling), SwiGLU with optional FFN tiles
    loss.py       next-token cross-entropy: the standard path and the chunked one that never holds the logits
    offload.py    activation offload: what the blocks save for backward lives in host memory
    memtrack.py   the live-bytes tracker behind every memory number and memory test
"""
