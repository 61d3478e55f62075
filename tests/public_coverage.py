"""Which public functions, classes and methods of tfpar a test run never executed.

Run the tier under coverage, then this script (coverage and pytest-cov are not project
dependencies: `pip install coverage pytest-cov` first):

    TFPAR_CALLS_FILE=/tmp/tfpar_calls python -m pytest -q --cov=tfpar --cov-report=
    python tests/public_coverage.py /tmp/tfpar_calls  # reads .coverage and the notes

A function (or method) counts as exercised when a statement of its body ran, or when code
traced by tf.function called it (AutoGraph runs a converted copy of traced code, which
coverage cannot see: tests/conftest.py notes those calls when TFPAR_CALLS_FILE is set); a
class when any of its methods ran. Public: no leading underscore in the module, class or
function name, `__init__` and `__call__` included. Exit code 1 when something never ran.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = ("__init__", "__call__")


def _body_lines(node: ast.AST) -> set[int]:
    """The statement lines of a def or class body, its docstring left out."""
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return {n.lineno for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.stmt)}


def _public(name: str) -> bool:
    return not name.startswith("_") or name in SPECIAL


def never_ran(path: Path, executed: set[int], traced: set[str] = frozenset()) -> list[str]:
    """'module.Name' / 'module.Class.method' entries of `path` none of whose statements ran
    (`traced`: 'module.qualname' of the functions traced code called)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)

    def ran(node, qualname: str) -> bool:
        return bool(_body_lines(node) & executed) or f"{module}.{qualname}" in traced

    missing = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
            if not ran(node, node.name):
                missing.append(f"{module}.{node.name}")
        elif isinstance(node, ast.ClassDef) and _public(node.name):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if methods and not any(ran(m, f"{node.name}.{m.name}") for m in methods):
                missing.append(f"{module}.{node.name}")
                continue
            missing += [f"{module}.{node.name}.{m.name}" for m in methods
                        if _public(m.name) and _body_lines(m) and not ran(m, f"{node.name}.{m.name}")]
    return missing


def main() -> int:
    data = coverage.Coverage(data_file=str(ROOT / ".coverage")).get_data()
    data.read()
    traced = set()
    if len(sys.argv) > 1:  # the notes of every process: PATH.PID
        for notes in Path(sys.argv[1]).parent.glob(Path(sys.argv[1]).name + ".*"):
            traced |= set(notes.read_text().split())
    missing, files = [], 0
    for path in sorted((ROOT / "tfpar").rglob("*.py")):
        files += 1
        missing += never_ran(path, set(data.lines(str(path)) or ()), traced)
    for name in missing:
        print(name)
    print(f"{files} modules; {len(missing)} public functions, classes or methods never ran", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
