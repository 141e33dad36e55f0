"""Reference pages of the documentation generated from the code (config models, CLI parsers, metrics, routes).

`python -m docs_gen` (`make docs-reference`) writes them under docs/reference/; `--check` lists stale ones.
"""
