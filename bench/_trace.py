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

SYSCALLS = "sendto,recvfrom"
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
