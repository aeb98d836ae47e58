"""Mixture of experts: the router and its losses (`routing.py`), the token
dispatch and the grouped experts (`experts.py`), the block that replaces
a layer's MLP (`block.py`) and the aux-loss-free expert bias (`balance.py`)."""
from megaresil.model.moe.balance import ExpertBalance, named_state_buffers
from megaresil.model.moe.block import MoEBlock, MoELossScale, has_experts

__all__ = ["ExpertBalance", "MoEBlock", "MoELossScale", "has_experts", "named_state_buffers"]
