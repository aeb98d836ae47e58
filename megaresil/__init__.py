"""megaresil: Megatron-style 3D-parallel GPT training with resiliency built in."""

__version__ = "0.1.0"
