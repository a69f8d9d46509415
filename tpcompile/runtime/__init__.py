"""Layer 2, runtime: what a rewritten graph and the module around it call while they run
(collectives, timeouts, rank agreement, input checks, randomness, vocabulary-parallel ops)."""
