"""Hugging Face checkpoints in and out (GPT-2 and Llama families); imported on demand.

families.py      which family a config is; the configs both ways
layouts.py       the one name table: each of our tensors and the HF tensors it is made of
weight_files.py  which files of a folder hold the weights
folder.py        read or write a whole folder (full tensors)
lazy.py          a folder read lazily: each rank reads only its shards
bin.py           pytorch_model.bin: read safely, converted to safetensors
export.py        a sharded HF folder written from a stream of our tensors
"""
