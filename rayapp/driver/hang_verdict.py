"""Which ranks a hang is about, read from every rank's stack.

In a hang the healthy ranks wait inside a collective (an all-reduce, a barrier, DDP's gradient
all-reduce at the end of backward) for a peer that never joins it. The culprits are the ranks
that are not in that collective: stuck elsewhere (a sleep, a deadlock, a data loader), in a
different collective, or with no stack at all (the process or its node is gone). When every rank
waits in the same collective, no rank stands apart: the link between them is the suspect.

Stacks are read as ``py-spy dump`` prints them (``Thread 2350 (idle): "name"``, then
``    function (file.py:12)``) or as faulthandler writes them (``Thread 0x00007f... (most recent
call first):``, then ``  File "file.py", line 12 in function``); both list the innermost frame
first.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_PY_SPY_THREAD = re.compile(
    r'^Thread (?P<id>\d+|0x[0-9A-Fa-f]+)(?: \((?P<state>[^)]*)\))?: "(?P<name>.*)"'
)
_FAULTHANDLER_THREAD = re.compile(r"^(?:Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)")
_PY_SPY_FRAME = re.compile(r"^\s+(?P<function>\S.*?) \((?P<file>[^()]*):(?P<line>\d+)\)$")
_FAULTHANDLER_FRAME = re.compile(
    r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<function>\S+)'
)
SOURCE_PREFIX = "        > "
"""Marks the source line added under a frame (:func:`with_source_lines`)."""

COLLECTIVE_FILES = ("torch/distributed/", "torch/nn/parallel/distributed.py")
"""Frames in these files are torch.distributed's waits: collectives, DDP's buffer and bucket
syncs."""
BACKWARD_FILE = "torch/autograd/"
"""DDP all-reduces gradients during backward and waits for the result before it returns."""
NOT_A_WAIT = {"wrapper"}
"""c10d's logging decorator (py-spy: ``_exception_logger.<locals>.wrapper``): the collective's
own name is the next frame out."""


@dataclass(frozen=True)
class Frame:
    function: str
    file: str


@dataclass(frozen=True)
class Thread:
    ident: str
    """py-spy's native thread id (decimal) or faulthandler's pthread id (hex)."""
    name: str
    frames: tuple[Frame, ...]
    """Innermost first."""


def parse_threads(text: str) -> list[Thread]:
    """The threads of one process's stack dump, in either format."""
    threads: list[Thread] = []
    current: tuple[str, str, list[Frame]] | None = None
    for line in text.splitlines():
        header = _PY_SPY_THREAD.match(line) or _FAULTHANDLER_THREAD.match(line)
        if header is not None:
            if current is not None:
                threads.append(Thread(current[0], current[1], tuple(current[2])))
            groups = header.groupdict()
            current = (groups["id"], groups.get("name") or "", [])
            continue
        frame = _frame(line)
        if frame is not None and current is not None:
            current[2].append(Frame(frame["function"], frame["file"].replace("\\", "/")))
    if current is not None:
        threads.append(Thread(current[0], current[1], tuple(current[2])))
    return threads


def _frame(line: str) -> re.Match[str] | None:
    if line.startswith(SOURCE_PREFIX):
        return None
    return _PY_SPY_FRAME.match(line) or _FAULTHANDLER_FRAME.match(line)


def with_source_lines(text: str) -> str:
    """The dump with each frame's source line under it, read where the files are (the rank's
    node), so that a stack says what the rank was doing (``time.sleep(10**6)``), not only where."""
    import linecache

    out: list[str] = []
    for line in text.splitlines():
        out.append(line)
        frame = _frame(line)
        if frame is not None:
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            if source:
                out.append(SOURCE_PREFIX + source)
    return "\n".join(out) + "\n"


def training_thread(threads: list[Thread], where: Mapping[str, Any]) -> Thread | None:
    """The thread that runs the loop: the one the rank's heartbeat named, else Ray Train's
    training thread by name."""
    idents = {str(where.get("thread_id")), f"0x{int(where.get('thread_ident') or 0):016x}"}
    for thread in threads:
        if thread.ident in idents or thread.ident.lower() in idents:
            return thread
    return next((t for t in threads if t.name.startswith("TrainingThread")), None)


def waiting_in(thread: Thread) -> str | None:
    """The collective the thread waits in (its outermost torch.distributed call, so that
    ``all_reduce`` is named rather than an internal helper), or None when it is elsewhere."""
    collective: str | None = None
    for frame in thread.frames:  # innermost first
        if any(part in frame.file for part in COLLECTIVE_FILES):
            if frame.function.rsplit(".", 1)[-1] not in NOT_A_WAIT:
                collective = frame.function
        elif collective is None and BACKWARD_FILE in frame.file and "backward" in frame.function:
            return "backward (DDP's gradient all-reduce)"
        elif collective is not None:
            return collective
    return collective


@dataclass(frozen=True)
class Verdict:
    hung_ranks: tuple[int, ...]
    """The ranks outside the collective the others wait in (every rank when none stands apart)."""
    waiting_ranks: tuple[int, ...]
    collective: str | None
    """What the waiting ranks wait in; None when no rank does."""
    where: Mapping[int, str]
    """rank -> what it is doing: the collective, or its innermost frame."""
    nodes: Mapping[int, str]
    """rank -> its node's IP."""
    stands_apart: bool
    """Whether some ranks differ from the others (False: every rank looks the same)."""

    def culprits(self) -> str:
        """'rank 1 (node 127.0.0.3)' or 'ranks 1, 2 (nodes 127.0.0.3, 127.0.0.4)'."""
        ranks = self.hung_ranks
        nodes = sorted({self.nodes.get(rank, "?") for rank in ranks})
        rank_word, node_word = ("rank", "node") if len(ranks) == 1 else ("ranks", "nodes")
        if len(nodes) > 1 and len(ranks) == 1:
            node_word = "nodes"
        return f"{rank_word} {', '.join(map(str, ranks))} ({node_word} {', '.join(nodes)})"

    def summary(self) -> str:
        """One sentence: who is hung, where, and what the others wait in."""
        if not self.stands_apart:
            if self.collective is None:
                return (
                    f"no rank is in a collective and none stands apart: {self.culprits()} all "
                    f"stopped outside torch.distributed ({self._doing()})"
                )
            return (
                f"every rank waits in {self.collective}: none stands apart, so the link between "
                f"{self.culprits()} is the suspect (a lost or stalled network path)"
            )
        if self.collective is None:
            return f"{self.culprits()} stopped ({self._doing()}); no rank is in a collective"
        waiting = ", ".join(map(str, self.waiting_ranks))
        return (
            f"{self.culprits()} is not in the {self.collective} that rank(s) {waiting} wait in "
            f"({self._doing()})"
        )

    def _doing(self) -> str:
        return "; ".join(f"rank {rank}: {self.where[rank]}" for rank in self.hung_ranks)


def judge(stacks: Mapping[int, str], ranks: Mapping[int, Mapping[str, Any]]) -> Verdict:
    """Compare every rank's training thread. `stacks`: rank -> dump text ("" when none was
    read); `ranks`: rank -> its heartbeat report (node_ip, thread ids, ``no_stack``: why none
    was read, where that is known, and ``silent``: its heartbeats stopped)."""
    where: dict[int, str] = {}
    collectives: dict[int, str | None] = {}
    for rank in sorted(ranks):
        thread = training_thread(parse_threads(stacks.get(rank, "")), ranks[rank])
        if thread is None or not thread.frames:
            reason = ranks[rank].get("no_stack") or "no stack: its process or node is gone"
            where[rank], collectives[rank] = reason, None
            continue
        collective = waiting_in(thread)
        collectives[rank] = collective
        innermost = thread.frames[0]
        where[rank] = collective or f"in {innermost.function} ({innermost.file.rsplit('/', 1)[-1]})"
    counts = Counter(c for c in collectives.values() if c is not None)
    collective = counts.most_common(1)[0][0] if counts else None
    waiting = tuple(rank for rank, c in collectives.items() if c is not None and c == collective)
    apart = tuple(rank for rank in collectives if rank not in waiting)
    silent = tuple(rank for rank in sorted(ranks) if ranks[rank].get("silent"))
    if silent and len(silent) < len(ranks):
        # A rank whose heartbeats stopped while others still beat is the culprit, whatever the
        # others were caught doing: its node is gone or cut off, and they wait for it, in a
        # collective or in Ray Train's own report (which is not torch.distributed's).
        waiting = tuple(rank for rank in sorted(ranks) if rank not in silent)
        apart = silent
    return Verdict(
        hung_ranks=apart or tuple(sorted(ranks)),
        waiting_ranks=waiting,
        collective=collective,
        where=where,
        nodes={rank: str(report.get("node_ip", "?")) for rank, report in ranks.items()},
        stands_apart=bool(apart) and bool(waiting),
    )
