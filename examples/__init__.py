"""Extensions written outside the model code, each one file and one registry line (the tests use them):

    sliding_window_attention.py  an attention type: causal attention over the last `window` positions
    norm_finetune.py             a fine-tuning mode: train only the RMSNorm gains on a frozen base
"""
