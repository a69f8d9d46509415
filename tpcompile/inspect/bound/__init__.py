"""Megatron's bound: the plan Megatron-LM would write for a model (bound.py), from the layers
its graph reader finds (bound_graph). ``explain``'s verdict, ``trace`` and the benches compare
tpcompile's collectives with it.

The package exports the bound, so ``from tpcompile.inspect.bound import megatron_bound`` keeps
working.
"""

from tpcompile.inspect.bound.bound import BlockBound, Bound, megatron_bound

__all__ = ["Bound", "BlockBound", "megatron_bound"]
