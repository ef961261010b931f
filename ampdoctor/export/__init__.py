"""Exports of a run to other tools: TensorBoard (:mod:`.tensorboard`), from the plain series of
:mod:`.series`."""
