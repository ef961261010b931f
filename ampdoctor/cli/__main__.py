"""``python -m ampdoctor.cli``: the ``ampdoctor`` command, where its script is not on the PATH."""

from .commands import main

main(prog_name="ampdoctor")
