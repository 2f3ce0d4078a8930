"""Python source read into an AST, for the tests that read the tree's modules (layering, tree
shape, suite layout, the registry's names).

CPython 3.11 before 3.11.8 (gh-106905) keeps the AST constructor's recursion counter per
interpreter, not per thread, and leaves it off after a failed conversion: `ast.parse` can then
raise a spurious "AST constructor recursion depth mismatch" SystemError (seen once in a
fresh-clone run, in an xdist worker whose engine pool runs apps in threads; the pythonic tool
parser uses `ast`). The same source parses on a retry."""

from __future__ import annotations

import ast

_TRIES = 3


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    for attempt in range(_TRIES):
        try:
            return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == _TRIES - 1:
                raise
    raise AssertionError("unreachable")
