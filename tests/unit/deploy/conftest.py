"""Fixtures of the deployment tests (the helpers live in deploy_support.py, importable by name)."""

from deploy_support import helm, render

__all__ = ["helm", "render"]
