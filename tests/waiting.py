"""Waiting in tests: a condition polled until it holds, within a deadline."""
import time
from collections.abc import Callable


def until(done: Callable[[], object], timeout_s: float = 30.0, what: str = "the condition",
          every_s: float = 0.05) -> None:
    """Polls `done` until it returns something true; AssertionError naming `what` if it has
    not within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s:.0f} s"
        time.sleep(every_s)
