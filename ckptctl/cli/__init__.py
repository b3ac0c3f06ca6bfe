"""The command line: one thin typer module per verb that parses, calls the library and
renders its result (rich on a TTY, ``--json`` everywhere); no logic of its own.

Imports every package below it (lazily, so ``--help`` stays fast); nothing imports it."""
