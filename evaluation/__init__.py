"""Does a model use its context (eval.py is the command line):

    tasks.py    loss by position, retrieval grids, recall by distance, document log-likelihoods; tables and plots
    harness.py  lm-evaluation-harness (RULER included) on any checkpoint, through the project's model
"""
