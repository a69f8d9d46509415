"""The ``diff`` command: the graph before and after the rewrite as readable code (diff.py) and
its side-by-side HTML page (diff_html).

The package exports the command, so ``from tpcompile.inspect.diff import diff`` keeps working;
``tpcompile.diff`` is the same function.
"""

from tpcompile.inspect.diff.diff import GraphDiff, diff, render_code

__all__ = ["GraphDiff", "diff", "render_code"]
