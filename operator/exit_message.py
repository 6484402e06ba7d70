"""Pure: the line of a container's termination message that says why it stopped.

The runtime writes its own one-line reason to the termination log when it can. When it cannot (a crash
in C++, a fatal signal, torchrun reporting a dead rank), the kubelet falls back to the end of the
container's log (`terminationMessagePolicy: FallbackToLogsOnError`): up to 80 lines, whose first line is
cut wherever 2 KB start. An Event that quoted its beginning would show the middle of a module list;
`exit_reason` picks the lines that name the cause instead.
"""

from __future__ import annotations

import re

# Lines that name a cause; kept whole (blanks collapsed), in the log's order.
_CAUSES = (
    re.compile(r"^Fatal Python error: .+"),  # faulthandler: SIGSEGV, SIGABRT, ...
    re.compile(r"^terminate called .+"),  # a C++ exception nobody caught (gloo, NCCL)
    re.compile(r"^\s*what\(\):\s+.+"),  # ...and what it said
    re.compile(r"^\s*exitcode\s*:\s+.+"),  # torchrun's "Root Cause" block
    re.compile(r"^\s*traceback\s*:\s+(?!To enable traceback).+"),
)
# A Python exception's last line: `pkg.module.SomeError: text`.
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:.*)?$")
# At most this many cause lines are kept, joined by " | ".
MAX_CAUSES = 3


def exit_reason(message: str) -> str:
    """The cause lines of a termination message, or the message itself when it is one line (the
    runtime's own reason), or its last non-empty line when no line names a cause."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    causes = [" ".join(line.split()) for line in lines if any(p.match(line) for p in _CAUSES)]
    exceptions = [line for line in lines if _EXCEPTION.match(line)]
    if exceptions:
        # The last exception is the one that ended the process (earlier ones were handled or chained).
        causes.append(exceptions[-1])
    if not causes:
        return lines[-1]
    return " | ".join(dict.fromkeys(causes[:MAX_CAUSES]))
