"""Analyses of a loaded run: pure functions from a :class:`~ampdoctor.read.run.Run` to plain data (the
JSON contracts of ``docs/json-contracts.md``). Prose is the renderers' (:mod:`ampdoctor.render`)."""
