"""Checkpoints that do not depend on the layout that wrote them.

engine_state.py   an Engine's sharded states in and out (torch.distributed.checkpoint)
chunks.py         a rank's flat ranges of a tensor as DCP chunks (save and load plans)
layout.py         what a checkpoint folder holds, by name; CheckpointError
folders.py        the folder: crash-safe commit, `latest`, pruning, checks
checksums.py      the recorded checksums checked, alone or divided among ranks
raw.py            pieces stored as their raw bytes, in DCP's layout of files and index
hashing.py        the writer that hashes each shard file as it writes it
offline_read.py   read tensors of a checkpoint in one process (convert, export)
offline_write.py  write a checkpoint from full tensors in one process (convert)
saver.py          a run's saves, synchronous or in the background
full_state.py     the full (tp=1) model streamed out of an Engine; safetensors
"""
