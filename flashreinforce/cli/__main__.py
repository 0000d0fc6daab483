"""``python -m flashreinforce.cli COMMAND ...`` (how torchrun launches the trainer)."""

from flashreinforce.cli import console

console()
