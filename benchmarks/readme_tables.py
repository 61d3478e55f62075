"""The generated tables of a results README: each sits between `<!-- table: NAME -->` and
`<!-- /table -->` and is rebuilt from the JSON files by TABLES[NAME]() (lines of markdown).
Shared by compression_report.py and placement_report.py.

Example:
    >>> sys.exit(readme_tables.main(README, TABLES, "Tables of the compression README"))
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, Mapping

MARKED = re.compile(r"(<!-- table: (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)
Tables = Mapping[str, Callable[[], list]]


def render(text: str, tables: Tables) -> tuple[str, list[str]]:
    """`text` with every marked table rebuilt, and the names of the tables found."""
    found = []

    def fill(match):
        name = match.group(2)
        if name not in tables:
            raise SystemExit(f"unknown table {name!r}; known: {', '.join(tables)}")
        found.append(name)
        return match.group(1) + "\n".join(tables[name]()) + "\n" + match.group(4)
    return MARKED.sub(fill, text), found


def main(readme: str, tables: Tables, description: str) -> int:
    """The scripts' command line: rewrite the README's tables, --check them, or --print one."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 if a table differs from its JSONs")
    parser.add_argument("--print", dest="show", choices=sorted(tables), help="print one table and stop")
    args = parser.parse_args()
    if args.show:
        print("\n".join(tables[args.show]()))
        return 0
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    new, found = render(text, tables)
    missing = [name for name in tables if name not in found]
    if missing:
        print(f"tables with no marker in the README: {', '.join(missing)}")
    if args.check:
        print("the README's tables differ from their JSONs" if new != text else "every table matches its JSON")
        return 1 if new != text or missing else 0
    if new != text:
        with open(readme, "w", encoding="utf-8") as f:
            f.write(new)
    print("rewrote the README's tables" if new != text else "nothing to rewrite")
    return 0
