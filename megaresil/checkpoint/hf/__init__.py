"""Hugging Face `transformers` models in and out of megaresil checkpoints:
the name, layout and config mapping (mapping.py), model directories read and
written (io.py), and the tokenizer files of an export (tokenizer.py)."""
