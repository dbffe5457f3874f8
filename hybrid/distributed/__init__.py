"""Processes and their groups: the one topology object every collective's group comes from.

env.py          process start from torchrun's variables (gloo or nccl), barrier, shutdown
topology.py     the 2D (tp x dp) mesh and its groups
comm.py         Group: the collectives our code issues, counted, on one process group
pairwise.py     ZeRO's all-gather (and a pair's reduce-scatter) as direct sends on gloo
host_memory.py  hand freed heap back to the system (glibc's malloc_trim)
"""
