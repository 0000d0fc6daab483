"""Freezing a rollout worker's process while it holds prompts, for the tests that kill one."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable


def frozen_holding(pid: int, held: Callable[[], Any], *, settle_s: float = 0.3, reads: int = 3) -> Any:
    """Freeze process ``pid`` (SIGSTOP) and return what ``held()`` says once it has stopped changing:
    the same non-empty answer ``reads`` times, ``settle_s`` apart, so that a call the process sent just
    before it froze (a put still queued at the buffer actor of a busy machine) has landed. The
    process stays frozen for the caller to kill. ``None`` (the process resumed) when it holds
    nothing or the answer never settles within 30 s."""
    os.kill(pid, signal.SIGSTOP)
    last, same = None, 0
    deadline = time.monotonic() + 30
    while same < reads and time.monotonic() < deadline:
        time.sleep(settle_s)
        now = held()
        same = same + 1 if now == last else 1
        last = now
    if not last or same < reads:
        os.kill(pid, signal.SIGCONT)
        return None
    return last
