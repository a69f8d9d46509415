"""Fail fast when tpcompile is not installed (``passes/`` only exists as tpcompile.passes)."""

try:
    import tpcompile.passes  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover
    raise SystemExit("tpcompile is not installed: run `pip install -e '.[test]'` first") from e
