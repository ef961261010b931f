"""The recording wing: everything that runs inside the user's training process.

``scaler`` (the public ``GradScaler``, ``wrap``) builds a ``Recorder`` (``recorder``), which wires
the module taps (``hooks``, ``call_graph``, ``light_taps``, ``gemm_operands``), the parameter index
(``parameters``), the measured-underflow backward (``underflow_probe``), the step plan (``plan``,
``options``) and the flight recorder (``anomalies``, ``live_status``); each step's device results
(``records``, ``transfer``) become rows (``rows``) handed to the background ``writer`` (``handoff``),
closed at exit by ``shutdown``. ``run_metadata`` and ``run_identity`` fill the segments' footers.

It imports the run file's format (:mod:`ampdoctor.run_file`) and the device statistics
(:mod:`ampdoctor.stats`), never the reading side, the analyses or the renderers (pyproject.toml,
``[tool.importlinter]``)."""
