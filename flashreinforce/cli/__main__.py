"""``python -m flashreinforce.cli COMMAND ...`` (how torchrun launches the trainer)."""

import sys

from flashreinforce.cli import main

sys.exit(main())
