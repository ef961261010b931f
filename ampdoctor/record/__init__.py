"""The recording wing: everything that runs inside the user's training process.

``scaler`` (the public ``GradScaler``, ``wrap``) builds a ``Recorder`` (``recorder``), which wires
the module taps (``hooks``, ``call_graph``, ``light_taps``, ``gemm_operands``), the parameter index
(``parameters``), the optimizers' steps and parameter checks (``param_checks``), the measured-
underflow backward (``underflow_probe``, driven by ``measured_steps``), the step plan (``plan``,
``options``) and the flight recorder (``anomalies``, ``live_status``). Each step's device results
(``records``) are handed to the background ``writer`` by ``handoff`` (host copies sealed by a
``transfer`` fence) and become rows there (``rows``); ``shutdown`` closes what is open at exit.
``run_metadata`` and ``run_identity`` fill the segments' footers.

It imports the run file's format (:mod:`ampdoctor.run_file`) and the device statistics
(:mod:`ampdoctor.stats`), never the reading side, the analyses or the renderers (pyproject.toml,
``[tool.importlinter]``)."""
