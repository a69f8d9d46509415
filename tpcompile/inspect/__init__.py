"""Inspection, one subpackage per command, and what the commands share at the top.

``explain/`` (the plan and its cost), ``advise/`` (how to split a model over GPUs), ``diff/``
(the rewrite as code) and ``bound/`` (Megatron's bound, which explain's verdict and the
benches read). Shared here: ``trace`` (one capture and rewrite every command reads),
``traffic`` (the collectives of a rewritten graph and their bytes), ``chains`` (the plan's
column -> row chains) and ``executed`` (the collectives a real call dispatches).
"""
