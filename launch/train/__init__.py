"""The training run behind `launch.pretrain` and `launch.finetune`.

entry.py          arguments, the checks before any collective, the run and its errors
loop.py           the run: data, model, Engine, the step loop, evaluation, outputs
step.py           one optimizer step (micro-batches, loss, Engine.step) and evaluation
schedule.py       the learning-rate schedule
checkpointing.py  saving, resuming, verifying a resume
preemption.py     SIGTERM and non-finite losses, agreed by every rank
outputs.py        final weights, a sample, the summary line
"""
