"""Where `attach`'s words go: event lines and interval summaries (stdout,
or stderr when JSON lines take stdout), notes (stderr), or the live view
while it runs (rich); `-T` puts the wall-clock time on every text line."""
from __future__ import annotations

import time
from typing import Callable, TextIO


class Terminal:
    def __init__(self, text_out: TextIO, err: TextIO, timestamps: bool = False):
        self.text_out, self.err, self.timestamps = text_out, err, timestamps
        self.live = None                      # rich.live.Live while the view runs
        self.state = None                     # its TuiState (an event sink)
        self._snapshot: Callable | None = None

    def stamp(self, text: str) -> str:
        if not self.timestamps:
            return text
        now = time.strftime("%H:%M:%S")
        return "\n".join(f"{now} {line}" for line in text.split("\n"))

    def say(self, msg: str) -> None:
        """A note of the tool's own: the view's event log, or stderr."""
        if self.live is not None:
            self.state.note(msg)
            return
        print(self.stamp(f"greyhound-trace: {msg}"), file=self.err, flush=True)

    def tell(self, text: str) -> None:
        """An event's line or an interval summary for the text output (the
        live view shows the events itself)."""
        if self.live is None:
            print(self.stamp(text), file=self.text_out, flush=True)

    def start_view(self, snapshot: Callable):
        """The live view, drawn from `snapshot(state, elapsed_s, width)`;
        returns its state, which must see every event."""
        from rich.console import Console
        from rich.live import Live
        from .tui import TuiState, render
        self.state, self._snapshot = TuiState(), snapshot
        console = Console(file=self.text_out)
        self.live = Live(render(snapshot(self.state, 0.0, console.width)), console=console,
                         auto_refresh=False, transient=False, redirect_stdout=False,
                         redirect_stderr=False)
        self.live.start()
        return self.state

    def refresh(self, elapsed_s: float) -> None:
        from .tui import render
        self.live.update(render(self._snapshot(self.state, elapsed_s, self.live.console.width)),
                         refresh=True)

    def stop_view(self) -> None:
        if self.live is not None:
            self.live.stop()                  # what prints next goes below the last view
            self.live = None
