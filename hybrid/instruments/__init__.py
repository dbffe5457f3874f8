"""Instruments that look at the library from outside; the library never imports them.

dispatch_counters.py  collectives and FLOPs counted at torch's dispatcher
engine_memory.py      MemTracker's storages filed by what they are to an Engine
fake_world.py         one real rank, the rest of the world a fake process group
local_processes.py    run a function in N local gloo processes (tests, benchmarks)
"""
