"""What a person at a terminal does to a command: its stderr on a pseudo-terminal (what a
progress bar, drawn only on a terminal, shows them), and Ctrl-C reaching it."""
from __future__ import annotations

import os
import subprocess


def stderr_on_a_terminal(argv: list[str], *, env: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    """(exit status, everything written to stderr) of `argv`, stderr on a 24x120 pseudo-terminal
    (tqdm draws nothing on a 0-wide one), stdout discarded, no stdin. POSIX only (pty)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")


def default_sigint() -> None:
    """`preexec_fn` for a child a test will interrupt: SIGINT back to its default action. A shell
    starts background jobs with SIGINT ignored and children inherit that; Python then installs no
    KeyboardInterrupt handler, and the child would never see the test's Ctrl-C."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
