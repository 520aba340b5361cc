"""Progress of a sweep: a bar on a terminal (tqdm when installed, else a small built-in one), and
one line per finished item elsewhere (a log file, CI), where a redrawn bar would flood the log."""
from __future__ import annotations

import sys
import time


class SimpleBar:
    """``bench [#######.......] 52/120 0:41<0:38 causal L=4096 naive fwd: 812.3 ms``. On a terminal
    it redraws one line; elsewhere (a log file, CI) it prints one line per finished item."""

    def __init__(self, total: int, desc: str = "", file=None, width: int = 30):
        self.total, self.desc, self.width = max(total, 0), desc, width
        self.file = file or sys.stderr
        self.n, self.postfix, self.t0 = 0, "", time.perf_counter()
        self.tty = hasattr(self.file, "isatty") and self.file.isatty()
        if self.tty:
            self._draw()

    def set_postfix_str(self, text: str):
        self.postfix = text
        if self.tty:
            self._draw()

    def update(self, n: int = 1):
        self.n += n
        self._draw()

    def close(self):
        if self.tty:
            self.file.write("\n")
            self.file.flush()

    def _draw(self):
        frac = self.n / self.total if self.total else 1.0
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.n * (self.total - self.n) if self.n else 0.0
        fill = int(round(frac * self.width))
        line = (f"{self.desc} [{'#' * fill}{'.' * (self.width - fill)}] {self.n}/{self.total} "
                f"{_clock(elapsed)}<{_clock(eta)} {self.postfix}")
        if self.tty:
            self.file.write("\r" + line[:150].ljust(150))
        else:
            self.file.write(line + "\n")
        self.file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


def progress_bar(total: int, desc: str = "bench", disable: bool = False):
    """On a terminal tqdm if importable, else `SimpleBar`; elsewhere `SimpleBar`'s one line per
    finished item; ``disable=True`` gives a bar that prints nothing."""
    if disable:
        return _Silent()
    if not sys.stderr.isatty():
        return SimpleBar(total, desc)
    try:
        from tqdm import tqdm
    except ImportError:
        return SimpleBar(total, desc)
    return tqdm(total=total, desc=desc, unit="cfg", dynamic_ncols=True, file=sys.stderr)


class _Silent:
    def set_postfix_str(self, text): pass
    def update(self, n=1): pass
    def close(self): pass
    def __enter__(self): return self
    def __exit__(self, *exc): pass
