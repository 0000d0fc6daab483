"""Whether the installed compiled module (``flashreinforce._C``) has given operations.

The Python layer asks before routing work to an operation of the compiled core, so that a build
from an older checkout, or one without the extension, keeps the PyTorch path instead of failing at
the first call. Importing this module imports neither ``_C`` nor torch.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["compiled_has"]


@lru_cache(maxsize=None)
def compiled_has(*names: str) -> bool:
    """True when ``flashreinforce._C`` imports and defines every one of ``names``."""
    try:
        from flashreinforce import _C
    except ImportError:
        return False
    return all(hasattr(_C, n) for n in names)
