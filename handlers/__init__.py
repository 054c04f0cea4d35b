"""Behaviour: one package per capability, in the import order of docs/architecture.md
("Handler packages"), which the import-linter contracts of pyproject.toml enforce."""
