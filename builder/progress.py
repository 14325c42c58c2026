"""How a build shows its progress: numbered steps with their times, and bars within a step."""
from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True, highlight=False)


class StepLog:
    """`with step("title"):` prints "[i/total] title ..." and the step's time when it ends."""

    def __init__(self, total: int):
        self.index = 0
        self.total = total

    @contextmanager
    def __call__(self, title: str):
        self.index += 1
        console.print(f"[bold][{self.index}/{self.total}][/bold] {title} ...")
        start = time.perf_counter()
        yield
        console.print(f"      done in {time.perf_counter() - start:.1f}s")


@contextmanager
def progress_bar(what: str, total: int):
    """A bar of `total` items; yields the function that advances it by one."""
    with Progress(TextColumn(f"      {what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
