"""Megatron-LM / Megatron-Core checkpoints (torch_dist) in and out of
megaresil checkpoints: the one key table and the tensor transforms between
the two (names.py), a save directory's layout (directory.py), Megatron-LM's
args as megaresil's model (arguments.py), reading a Megatron save
(reading.py), writing one (writing.py)."""
