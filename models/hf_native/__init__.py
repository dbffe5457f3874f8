"""Hugging Face models trained as they are (tp=1, ZeRO 0-3): any AutoModelForCausalLM
folder, no conversion to our GPT. Imported on demand (transformers is heavy).

causal_lm.py       the model on meta, with the loop's interface (loss, logits, units)
weights.py         the folder's safetensors read lazily: a rank reads its shards
export.py          the trained model written back as a folder from_pretrained loads
sharded_folder.py  sharded safetensors and index from a stream (both exports use it)
"""
