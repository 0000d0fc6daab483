"""Ctrl-C (and SIGTERM, what schedulers send) answered at once, even while the main thread is inside a
long C++ call.

Python runs a signal handler only when the main thread is back in the interpreter. During a
learner update of a real model the main thread spends seconds inside single PyTorch calls (one
micro-batch's backward, an optimizer step over every weight), so a handler that prints "stopping"
would print it only when the call returns; with a slow dtype that was minutes after the key press.

:class:`InterruptWatch` therefore also gives the interpreter a wake-up pipe
(:func:`signal.set_wakeup_fd`): the C-level handler writes the signal number into it the moment
the signal arrives, and a small thread blocked on the pipe reads it and answers:

* first Ctrl-C: ``on_first()`` (the trainer sets its stop event: the run stops after the update in
  progress, saves a checkpoint and exits with status 130) and its one-line message, printed at once;
* second Ctrl-C: a line saying the run aborts; the Python handler then raises
  :class:`KeyboardInterrupt` in the main thread as soon as it is back in Python (no save);
* third Ctrl-C: the process exits with status 130 immediately (``os._exit``), for a main thread
  stuck in a call that does not return.

The Python-level handler does the same counting, so the behaviour holds when the wake-up pipe
is unavailable (another wake-up fd in use, a platform without it). Install from the main thread.

``SIGTERM`` is answered exactly like Ctrl-C and counts with it (:attr:`InterruptWatch.first_signal`
says which came first): a scheduler's SIGTERM stops the run after the update in progress with a
checkpoint (the exit status is then 143), where it used to end the process at once without one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable

__all__ = ["InterruptWatch", "SIGNALS", "signal_label"]

#: The signals answered: Ctrl-C and a scheduler's (or ``kill``'s) SIGTERM.
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_label(signum: int | None) -> str:
    """``Ctrl-C`` for SIGINT, the signal's name otherwise."""
    if signum is None or signum == signal.SIGINT:
        return "Ctrl-C"
    return signal.Signals(signum).name


class InterruptWatch:
    """``SIGINT`` handling for the training loop (see the module docstring).

    ``on_first``: called once, at the first Ctrl-C (from the watcher thread or the main thread);
    ``first_message``: a callable giving the line printed then (evaluated at that moment).
    """

    def __init__(self, on_first: Callable[[], None], first_message: Callable[[], str]) -> None:
        self._on_first = on_first
        self._first_message = first_message
        self._handled = self._watched = self._answered = 0
        self._lock = threading.Lock()
        self._old_handlers: dict[int, object] = {}
        #: The first signal answered (SIGINT or SIGTERM), or ``None``.
        self.first_signal: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self.installed = False

    # ----------------------------------------------------------------- what a Ctrl-C does
    # Each press reaches both the watcher (one byte per signal) and, later, the Python handler (which
    # CPython may call once for several presses that arrived during one C call): the presses are the
    # larger of the two counts, and each is answered once, by whichever side counts it first.
    def _counted(self, *, by_handler: bool, signum: int = signal.SIGINT) -> int:
        with self._lock:
            if self.first_signal is None:
                self.first_signal = signum
            if by_handler:
                self._handled += 1
            else:
                self._watched += 1
            presses = max(self._handled, self._watched)
            todo = range(self._answered + 1, presses + 1)
            self._answered = max(self._answered, presses)
        for press in todo:
            self._answer(press)
        return presses

    def _answer(self, press: int) -> None:
        what = signal_label(self.first_signal)
        if press == 1:
            self._on_first()
            _say(self._first_message())
        elif press == 2:
            _say(f"flashreinforce: {what} again: aborting without a checkpoint, as soon as the current computation "
                 f"returns (a third {what} exits at once); --resume continues from the newest complete checkpoint")
        elif press == 3:
            code = 128 + int(self.first_signal or signal.SIGINT)
            _say(f"flashreinforce: {what} a third time: exiting now (status {code})")
            logging.shutdown()
            os._exit(code)

    def _handler(self, signum, frame) -> None:  # the main thread, back in Python
        if self._counted(by_handler=True, signum=signum) >= 2:
            raise KeyboardInterrupt

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return  # the write end was closed: uninstalled
            for byte in data:
                if byte in SIGNALS:
                    self._counted(by_handler=False, signum=byte)

    # ----------------------------------------------------------------- install / uninstall
    def install(self) -> None:
        """Take over ``SIGINT`` and ``SIGTERM`` (main thread only; elsewhere nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._old_handlers = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        try:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)  # the C handler must never block
            old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            if old != -1:  # someone else's (an event loop in this thread): leave it to them
                signal.set_wakeup_fd(old)
                os.close(read_fd)
                os.close(write_fd)
            else:
                self._pipe = (read_fd, write_fd)
                self._thread = threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                                                name="flashreinforce-ctrl-c")
                self._thread.start()
        except (OSError, ValueError):
            self._pipe = None
        self.installed = True

    def uninstall(self) -> None:
        """Give ``SIGINT`` and ``SIGTERM`` back to the handlers that were there before :meth:`install`."""
        if not self.installed:
            return
        self.installed = False
        if self._pipe is not None:
            signal.set_wakeup_fd(-1)
            read_fd, write_fd = self._pipe
            self._pipe = None
            os.close(write_fd)  # the watcher's read returns b"" and it ends
            if self._thread is not None:
                self._thread.join(timeout=1.0)
            os.close(read_fd)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)


def _say(line: str) -> None:
    try:
        print("\n" + line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
