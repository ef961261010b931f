"""The reading wing: a run directory read back as a :class:`~ampdoctor.read.run.Run`.

``run`` lists a directory's segments and reads them into frames (``read_run``, ``load``; each
footer is checked by :mod:`ampdoctor.run_file.segment`), ``watch`` follows a run while it is
written and ``migrate`` rewrites older segments in the current schema. This is the one place a run
is opened: the analyses take a ``Run``. It imports the run file's format
(:mod:`ampdoctor.run_file`), never the recording side, nor torch."""
