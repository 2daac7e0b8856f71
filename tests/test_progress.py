"""Progress (pipeline/progress.py): a bar on a real terminal (a pty), plain lines in a file."""
from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import termios

from pipeline.progress import Progress


def test_in_a_file_progress_is_lines_without_redraws(monkeypatch):
    monkeypatch.setenv("PROGRESS_EVERY_S", "0")                 # a line at every update
    out = io.StringIO()
    with Progress(4, "train", unit="img", file=out) as progress:
        for _ in range(4):
            progress.set_postfix(loss="0.5")
            progress.update()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [re.match(r"train: (\d)/4 img", line)[1] for line in lines] == ["0", "1", "2", "3", "4", "4"]
    assert lines[-1].startswith("train: 4/4 img (100%), ") and "img/s" in lines[-1] and lines[-1].endswith("; loss 0.5")
    assert "left" in lines[-3] and "left" not in lines[-1]


def test_in_a_file_lines_come_every_n_seconds_and_the_caller_may_keep_the_last(monkeypatch):
    monkeypatch.delenv("PROGRESS_EVERY_S", raising=False)      # the default: every 30 s
    out = io.StringIO()
    progress = Progress(1000, "epoch 1/2", unit="ba", initial=10, file=out, closing_line=False)
    for _ in range(990):
        progress.update()
    progress.close()
    assert out.getvalue().splitlines() == ["epoch 1/2: 10/1,000 ba (1%), 00:00 elapsed"]   # the start only
    silent = io.StringIO()
    Progress(5, "x", file=silent, enabled=False).update(5)
    assert silent.getvalue() == ""


def test_on_a_terminal_progress_is_a_bar(monkeypatch):
    monkeypatch.setenv("PROGRESS_EVERY_S", "0")
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))   # a new pty is 0 columns wide
    with os.fdopen(follower, "w") as terminal:
        with Progress(3, "val", unit="img", file=terminal) as progress:
            progress.update(3)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:                                          # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    shown = shown.decode()
    assert "\r" in shown and "3/3" in shown and "val: 3/3 img (100%)" not in shown
