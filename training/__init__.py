"""Training: everything train.py runs, and the memory estimate that mirrors it.

    trainer.py        a run's setup in one order, one optimizer step, the loop (train.py is its command line)
    options.py        TrainConfig: every option, "auto" values resolved, a resumed run's options; the
                      fine-tuning registry
    modes.py          fine-tuning modes behind one protocol: full, LoRA, NPT
    lora.py           LoRA adapters in peft's layout
    quantize.py       weight-only int8 / nf4 / int4 of a frozen base (torchao)
    parallel.py       the process layout and FSDP2, in one function
    inputs.py         a run's tokenizer and data, checked before anything is prepared
    run_directory.py  one run per directory: the lock, the timelines, foreign directories refused
    monitor.py        metrics, memory, MFU, signals, the CPU thread plan
    tracking.py       TensorBoard and W&B
    estimate.py       profile_memory.py's engine: one step under fake tensors, its report
    fit.py            whether a step fits a GPU, and the cheapest change that makes it fit
    cli.py            the command line's conventions: one-line errors, JSON options
"""
