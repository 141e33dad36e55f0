"""`python -m docs_gen` writes the generated reference pages; `--check` only says which are stale (exit 1)."""

from __future__ import annotations

import argparse
import sys

from docs_gen.markdown import REGENERATE_COMMAND
from docs_gen.pages import stale_pages, write_pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs_gen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for path in stale:
            print(f"{path}: stale; run `{REGENERATE_COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for path in write_pages():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
