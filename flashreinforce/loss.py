"""The pure-PyTorch reference of the objective, under its public name ``flashreinforce.loss``.

The code lives in :mod:`flashreinforce.ops.reference`; this module only re-exports it, so that
``from flashreinforce import loss`` keeps giving the readable definition.
"""

from flashreinforce.ops.reference import *  # noqa: F401,F403
from flashreinforce.ops.reference import __all__  # noqa: F401
