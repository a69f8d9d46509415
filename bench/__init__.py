"""The benchmarks: scripts run from the repository root as ``python -m bench.<name>``.

A package so the scripts import each other (``bench.memory``, ``bench.baselines``) and the
model zoo (``zoo``) by name, with the root on ``sys.path`` as ``-m`` puts it there; the gloo
ranks a script starts inherit that path. docs/performance.md lists what each measures.
"""
