"""The paper's figures and tables: ``python -m paper.figures [--small] [--out paper/figures]``."""
