"""torch.compile: inductor options for tensor-parallel graphs and the ``"tpcompile"`` Dynamo backend."""
