"""Native Sparse Attention (Yuan et al. 2025, https://arxiv.org/abs/2502.11089), one concept per module:

    reference.py       the paper's algorithm, one query at a time: the oracle of the tests, and the place to start
    layer.py           NativeSparseAttention: projections, gates, block compressor, decoding cache
    attention.py       sparse_attention: the three gated branches chunk by chunk, custom backward
    torch_path.py      the branches on PyTorch operators (CPU fused / explicit), for CPU tensors
    primitive.py       the CPU flash-attention call that also returns the log-sum-exp
    blocks.py          block geometry, Eq. 9's score pooling, top-n selection
    triton_path.py     the Triton path of the three branches (host side: allocations, grids), for CUDA tensors
    triton_kernels.py  the Triton kernels themselves, imported only to launch one
    scoring.py         the selection-scoring loss: teaches the importance scores which blocks to select
    memory_stand_in.py how profile_memory.py models the attention's memory (a calibrated stand-in)
    inspection.py      for a prompt: the blocks each KV group selected and the branch gates, layer by layer
                       (inspect_nsa.py is its command line)
    from_dense.py      dense attention weights -> NSA weights
"""
