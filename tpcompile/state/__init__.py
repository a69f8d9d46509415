"""State: shards of parameters, full state dicts in and out, meta-device builds, DCP, optimizers."""
