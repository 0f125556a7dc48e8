"""Lines and code lines of Python files: the size measure of issue 16's note.

A code line holds a token that is not part of a docstring (a module's, class's or
function's first string), a comment or blank space. Prints one row per file and a total.

    python tools/count_lines.py src/rcdl/app/experiments/*.py src/rcdl/app/cli.py

With ``--longest N`` it prints instead the ``N`` longest functions and methods of the files
(lines from ``def`` to the last line, docstring included), and each class's lines and
methods — e.g. ``python tools/count_lines.py --longest 10 $(git ls-files 'src/rcdl/*.py')``.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER)  # fmt: skip


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):  # fmt: skip
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines of ``source`` holding code (not docstring, comment or blank)."""
    docs = _docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def longest(paths: list[str], count: int) -> None:
    """The ``count`` longest functions of ``paths``, then every class's size."""
    functions, classes = [], []
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((size, f"{path}:{node.name}"))
            else:
                methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                              for n in node.body)
                classes.append((size, methods, f"{path}:{node.name}"))
    for size, name in sorted(functions, reverse=True)[:count]:
        print(f"{size:6d} {name}")
    print("classes (lines, methods):")
    for size, methods, name in sorted(classes, reverse=True):
        print(f"{size:6d} {methods:4d} {name}")


def main(paths: list[str]) -> None:
    total_lines = total_code = 0
    for path in paths:
        source = Path(path).read_text(encoding="utf-8")
        lines, code = len(source.splitlines()), code_lines(source)
        total_lines, total_code = total_lines + lines, total_code + code
        print(f"{lines:6d} {code:6d} {path}")
    print(f"{total_lines:6d} {total_code:6d} total (lines, code lines)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--longest":
        longest(sys.argv[3:], int(sys.argv[2]))
    else:
        main(sys.argv[1:])
