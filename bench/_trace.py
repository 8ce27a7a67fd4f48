"""One prepared transaction's timeline through a subscriber, from system-call traces (``live_bench.py --trace-dir``).

Why system calls: they are where a message changes hands, they are the same for native (C) and ours (Python), and
tracing them needs no change to either worker. While the load runs, ``strace -ttt -f`` follows the subscriber's
apply worker, its ``recvfrom`` and ``sendto`` only (native: the apply worker, a backend of the target; ours: the
``applier run`` worker process). Not the walsender: traced, it slowed so much (it makes several system calls per
message) that both sides fell behind. For each prepared transaction ``live_<xid>`` the points are:

* ``pub``: the publisher's PREPARE (``pg_prepared_xacts.prepared``, its own clock stamp);
* ``read``: the worker's first ``recvfrom`` that holds ``live_<xid>`` (the BEGIN PREPARE; a small transaction's
  changes and PREPARE come in the same read or right after it, the decision 20-100 ms later);
* ``out``: ours only: the worker's ``sendto`` of ``PREPARE TRANSACTION 'pg_gid_<subid>_<xid>'`` to the target;
* ``tgt``: the target's PREPARE starting (its ``pg_prepared_xacts.prepared`` stamp).

Segments: ``arrive`` = read - pub (the walsender decoding and sending, and the message waiting in the socket until
the worker reads it), ``worker`` = tgt - read (native: applying; ours: decoding, sending the statements, and the
target running them up to the PREPARE, our prepared record's local commit included), split for ours into
``apply`` = out - read (in the worker) and ``target`` = tgt - out (in the socket and the target backend, behind the
statements sent before).

strace slows every traced system call (tens of microseconds), so the absolute figures are inflated, more for the
side that makes more system calls per transaction (ours); what the timeline shows is which segment holds the tail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

SYSCALLS = "sendto,recvfrom,epoll_wait,epoll_pwait,poll,ppoll,select,pselect6"
_LINE = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s+(\d+\.\d+)\s+(.*)$")
_PUB_GID = re.compile(r"live_(\d+)\\0")
_TGT_GID = re.compile(r"PREPARE TRANSACTION 'pg_gid_\d+_(\d+)'")


def start(out_dir: Path, tag: str, pids: dict[str, int]) -> list[subprocess.Popen[bytes]]:
    """``strace`` each of ``pids`` (role -> pid) into ``out_dir/<tag>.<role>.strace``."""
    procs = []
    for role, pid in pids.items():
        cmd = ["strace", "-ttt", "-f", "--seccomp-bpf", "-s", "8192", "-e", f"trace={SYSCALLS}", "-o",
               str(out_dir / f"{tag}.{role}.strace"), "-p", str(pid)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Detach: SIGINT makes strace let go of the traced process and write out what it has."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGINT)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def events(path: Path, call: str, pattern: re.Pattern[str]) -> dict[int, float]:
    """xid -> time of the first ``call`` whose data matches ``pattern`` (a resumed call counts at its return)."""
    out: dict[int, float] = {}
    if not path.exists():
        return out
    with open(path, errors="replace") as f:
        for line in f:
            m = _LINE.match(line)
            if not m:
                continue
            rest = m.group(3)
            if not (rest.startswith(call + "(") or rest.startswith(f"<... {call} resumed>")):
                continue
            if "<unfinished ...>" in rest:
                continue
            for x in pattern.findall(rest):
                out.setdefault(int(x), float(m.group(2)))
    return out


def tail_split(segs_by_xid: dict[int, dict[str, float]], q: float = 99.0) -> dict[str, float]:
    """Mean of each segment over the transactions whose total is at or above the ``q``-th percentile: what the
    tail's time is made of."""
    from live_bench import percentile  # at call time: live_bench imports this module

    totals = [s["total"] for s in segs_by_xid.values() if "total" in s]
    if not totals:
        return {}
    cut = percentile(totals, q)
    tail = [s for s in segs_by_xid.values() if s.get("total", -1.0) >= cut]
    keys = sorted({k for s in tail for k in s})
    return {k: sum(s[k] for s in tail if k in s) / max(1, sum(1 for s in tail if k in s)) for k in keys} | {
        "n": float(len(tail))
    }


def per_xid(pub: dict[int, float], read: dict[int, float], out: dict[int, float],
            tgt: dict[int, float]) -> dict[int, dict[str, float]]:  # fmt: skip
    """Each transaction's segments (those whose points are known), in seconds."""
    res: dict[int, dict[str, float]] = {}
    for xid, t_pub in pub.items():
        s: dict[str, float] = {}
        if xid in tgt:
            s["total"] = tgt[xid] - t_pub
        if xid in read:
            s["arrive"] = read[xid] - t_pub
            if xid in tgt:
                s["worker"] = tgt[xid] - read[xid]
                if xid in out:
                    s["apply"], s["target"] = out[xid] - read[xid], tgt[xid] - out[xid]
        res[xid] = s
    return res


def analyse(out_dir: Path, tag: str) -> str:
    """A text report of one traced run: percentiles of each segment, and what the slowest 1 % are made of."""
    stamps = json.loads((out_dir / f"{tag}.prepares.json").read_text())
    pub = {int(k): v for k, v in stamps["pub"].items()}
    tgt = {int(k): v for k, v in stamps["tgt"].items()}
    read = events(out_dir / f"{tag}.worker.strace", "recvfrom", _PUB_GID)
    out = events(out_dir / f"{tag}.worker.strace", "sendto", _TGT_GID)
    from live_bench import percentile  # at call time: live_bench imports this module

    by_xid = per_xid(pub, read, out, tgt)
    segs: dict[str, list[float]] = {}
    for k in ("arrive", "worker", "apply", "target", "total"):
        segs[k] = [s[k] for s in by_xid.values() if k in s]
    lines = [f"{tag}: {len(pub)} prepared on the publisher, {len(read)} reads, {len(out)} "
             f"PREPARE sends, {len(tgt)} target stamps"]  # fmt: skip
    for k, v in segs.items():
        if v:
            lines.append(f"  {k:7} n={len(v):5}  p50 {percentile(v, 50) * 1000:7.2f}  p90 {percentile(v, 90) * 1000:7.2f}"
                         f"  p99 {percentile(v, 99) * 1000:7.2f}  max {max(v) * 1000:7.2f} ms")  # fmt: skip
    split = tail_split(by_xid)
    if split:
        n = int(split.pop("n"))
        lines.append(f"  slowest 1 % ({n} transactions), mean ms: "
                     + ", ".join(f"{k} {v * 1000:.2f}" for k, v in split.items()))  # fmt: skip
    return "\n".join(lines)


# --- plain transactions: how long ours holds a received COMMIT before sending its local COMMIT --------------------

_DATA = re.compile(
    r'(?:(recvfrom|sendto)\((\d+), |<\.\.\. (recvfrom|sendto) resumed>)"((?:[^"\\]|\\.)*)"(\.\.\.)?'
)
_ESC = {"n": 10, "t": 9, "r": 13, "v": 11, "f": 12, '"': 34, "\\": 92}


def unescape(s: str) -> bytes:
    """strace's C-style string back to bytes (``\\n``-style escapes and octal ``\\NNN``)."""
    out = bytearray()
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c != "\\":
            out += c.encode("latin-1", errors="replace")
            i += 1
            continue
        nxt = s[i + 1]
        if nxt in _ESC:
            out.append(_ESC[nxt])
            i += 2
            continue
        j = i + 1
        while j < n and j < i + 4 and s[j] in "01234567":
            j += 1
        out.append(int(s[i + 1 : j], 8) & 0xFF)
        i = j
    return bytes(out)


def io_events(path: Path) -> list[tuple[float, str, int, bytes, bool]]:
    """(time, call, fd, data, truncated) of every recvfrom/sendto with data, in order (a call split by another
    thread's is taken at its resumption, with the fd its start named)."""
    pending_fd: dict[str, int] = {}
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = _LINE.match(line)
            if not m:
                continue
            pid, t, rest = m.group(1), float(m.group(2)), m.group(3)
            if "<unfinished ...>" in rest:
                if fm := re.match(r"(recvfrom|sendto)\((\d+),", rest):
                    pending_fd[pid] = int(fm.group(2))
                continue
            d = _DATA.match(rest)
            if not d:
                continue
            call = d.group(1) or d.group(3)
            fd = int(d.group(2)) if d.group(2) else pending_fd.pop(pid, -1)
            out.append((t, call, fd, unescape(d.group(4)), bool(d.group(5))))
    return out


def pgoutput_kinds(reads: list[tuple[float, bytes, bool]]) -> tuple[list[tuple[float, int, str]], int]:
    """The pgoutput message kinds in a replication stream, each with the time and index of the read that completed
    it; and how many reads were truncated (strace's ``-s``: the stream is resynchronised at the next read)."""
    buf = b""
    kinds: list[tuple[float, int, str]] = []
    lost = 0
    for idx, (t, data, truncated) in enumerate(reads):
        if truncated:
            lost += 1
            buf = b""
            continue
        buf += data
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if len(buf) < 1 + length:
                break
            if buf[:1] == b"d" and buf[5:6] == b"w" and length > 29:
                kinds.append((t, idx, chr(buf[5 + 25])))
            buf = buf[1 + length :]
    return kinds, lost


def commit_holds(path: Path, marker: bytes = b"applier_commit") -> str:
    """For each plain transaction ours received (pgoutput 'C'), the time from the read that completed it to the
    first local COMMIT sent after it (``marker``: our prepared COMMIT statement's name), and whether another
    replication read came in between (the commit was held across a read: the group waited for the next
    transaction, or a pause)."""
    from live_bench import percentile  # at call time: live_bench imports this module

    ev = io_events(path)
    repl_fd = max({fd for _, c, fd, d, _ in ev if c == "recvfrom" and d[:1] == b"d"},
                  key=lambda fd: sum(1 for _, c, f, _, _ in ev if c == "recvfrom" and f == fd))  # fmt: skip
    reads = [(t, d, tr) for t, c, fd, d, tr in ev if c == "recvfrom" and fd == repl_fd]
    kinds, lost = pgoutput_kinds(reads)
    commits = [t for t, c, _, d, _ in ev if c == "sendto" and marker in d]
    import bisect

    held, crossed = [], 0
    read_times = [t for t, _, _ in reads]
    for t, idx, kind in kinds:
        if kind != "C":
            continue
        k = bisect.bisect_left(commits, t)
        if k == len(commits):
            continue
        held.append(commits[k] - t)
        if bisect.bisect_right(read_times, commits[k]) - 1 > idx:
            crossed += 1
    if not held:
        return f"{path.name}: no commits matched"
    return (f"{path.name}: {len(held)} remote commits, local COMMIT sent after the read: p50 "
            f"{percentile(held, 50) * 1000:.2f} p90 {percentile(held, 90) * 1000:.2f} p99 "
            f"{percentile(held, 99) * 1000:.2f} max {max(held) * 1000:.2f} ms; held across a later read: {crossed} "
            f"({crossed / len(held):.1%}); truncated reads: {lost}")  # fmt: skip
