"""Does a model use its context (eval.py is the command line):

    registry.py   what an evaluation task is (EvalTask, Setting) and the tasks by name (EVAL_TASKS, register_task)
    loss.py       loss by position on held-out windows; the validation loss train.py reports
    retrieval.py  passkey and needle grids: exact match and graded scores
    recall.py     mqar, mqar_text: recall accuracy by key-query distance
    documents.py  document log-likelihoods and bits per byte
    harness.py    lm-evaluation-harness (RULER included) on any checkpoint, through the project's model
"""
