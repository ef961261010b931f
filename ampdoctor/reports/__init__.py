"""Analyses of a loaded run (pure functions returning plain data) and their renderers."""
