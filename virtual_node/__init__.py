"""kubestrata virtual node: one lower cluster as one Node of the upper cluster."""

from virtual_node.main import main

__all__ = ["main"]
