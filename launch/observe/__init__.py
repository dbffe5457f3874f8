"""What a run reports about itself.

tracking.py     metrics to the console, a JSON-lines file and Weights & Biases
mfu.py          model FLOPs utilisation
peak_memory.py  the step's peak memory, every rank's, beside the planner's
matmul_rate.py  a small timed matmul: how fast this device multiplies in a dtype
"""
