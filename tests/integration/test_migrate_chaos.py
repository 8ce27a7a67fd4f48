"""Do no harm to the source (issue 43) under chaos: ``migrate start`` and ``migrate cutover`` killed or signalled at
random points of one migration, under a writer committing to the source all along. After every blow the source
takes writes again within 30 s (after a ``kill -9`` of a cutover under its fence together with its ``start``, the
machine that ran both lost: within 30 s of the next verb of the migration, which lifts the fence first), nothing but
the migration's own slot and publications is on the source, and a ``start`` that was the victim resumes; in the end
a clean cutover leaves the target equal to the source with every committed write and nothing of the migration on
the source, or an abort leaves the source writable with nothing of the migration on it.

The schedule comes from a seed: ``APPLIER_CHAOS_SEED=N`` replays a run (the seed and the schedule are printed first).
Two small deterministic tests pin two promises a random schedule hits only by chance: the fence of a cutover killed
with its ``start`` is reported by ``status`` and lifted by ``abort``, and a cutover waiting under its fence backs out
at once when ``start`` stops."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from applier.migrate.ownership import CUTOVER_NAMESPACE, START_NAMESPACE
from applier.testing import Database, assert_tables_equal, wait_until
from tests.support.cli import APPLIER
from tests.support.migrate import exit_status, following, migrate, phase, start

NAME = "mig"
TABLES = ("public.acc", "public.log", "public.items")
SCHEMA = """
CREATE TABLE acc (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v int NOT NULL);
CREATE TABLE log (id serial PRIMARY KEY, acc bigint REFERENCES acc, note text);
CREATE TABLE items (k int PRIMARY KEY, hits int NOT NULL DEFAULT 0, payload text);
CREATE SEQUENCE ticket_seq;
INSERT INTO acc (v) SELECT g FROM generate_series(1, 3000) g;
INSERT INTO log (acc, note) SELECT g, 'n' FROM generate_series(1, 3000) g;
INSERT INTO items (k, payload) SELECT g, md5(g::text) FROM generate_series(1, 2000) g;
SELECT setval('ticket_seq', 42);
"""
#: the source database's own setting, as the fence sets it (a new session reads it at its start)
READ_ONLY = (
    "SELECT coalesce(bool_or(c = 'default_transaction_read_only=on'), false) FROM pg_db_role_setting s,"
    " unnest(s.setconfig) c WHERE s.setrole = 0"
    " AND s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
#: who holds one of ownership's two-key advisory locks (its namespace, then the migration's name)
LOCK_HOLDERS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
    " AND classid = %s::int8::oid AND objid = hashtext(%s)::oid"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
SETTLED = (
    "SELECT s.subtwophasestate <> 'p' AND NOT EXISTS (SELECT FROM applier.subscription_rel r"
    " WHERE r.subid = s.subid AND r.srsubstate <> 'r') FROM applier.subscription s WHERE s.subname = %s"
)
#: a schedule that hits every point: start in its set-up, both sides of the fence, a machine lost under it
DEFAULT_SEED = 569
SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGKILL")
WRITABLE_WITHIN = 30.0


# --- the source, the target and the processes, as the tests look at them -------------------------------------------
def writable(db: Database) -> bool:
    """Whether a new session on the source can write a migrated table (a fresh connection: the fence is read by a
    session at its start); a refusal other than read-only is raised (``wait_until`` reports it)."""
    try:
        with psycopg.connect(db.dsn, autocommit=True, connect_timeout=5) as c:
            c.execute("INSERT INTO acc (v) VALUES (-1)")
    except psycopg.errors.ReadOnlySqlTransaction:
        return False
    return True


def read_only(db: Database) -> bool:
    return bool(db.scalar(READ_ONLY))


def writable_within(db: Database, since: float, what: str, limit: float = WRITABLE_WITHIN) -> float:
    """Wait until the source takes writes, at most ``limit`` seconds after ``since`` (monotonic); how long it took."""
    wait_until(lambda: writable(db), timeout=max(since + limit - time.monotonic(), 0.2), interval=0.05,
               what=f"the source writable within {limit:.0f}s of {what}")  # fmt: skip
    return time.monotonic() - since


def fenced_at(target: Database) -> Any:
    return target.scalar("SELECT fenced_at FROM applier.migration WHERE name = %s", (NAME,))


def error_of(target: Database) -> str:
    return str(target.scalar("SELECT error FROM applier.migration WHERE name = %s", (NAME,)) or "")


def locked(target: Database, namespace: int) -> bool:
    return bool(target.scalar(LOCK_HOLDERS, (namespace, NAME)))


def settled(target: Database) -> bool:
    """Every table ready and two-phase decided: the worker will not restart by itself (it does once, to turn
    two-phase on, after the last table is ready), so that a cutover finds it streaming."""
    return bool(target.scalar(SETTLED, (NAME,)))


def slot_state(source: Database) -> bool | None:
    """The migration's slot: None when absent, else whether something streams from it."""
    return source.scalar("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (NAME,))


def on_source(source: Database) -> tuple[set[str], set[str]]:
    """The replication slots of the source's database and its publications."""
    slots = "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
    return {r[0] for r in source.query(slots)}, {
        r[0] for r in source.query("SELECT pubname FROM pg_publication")
    }


def leftovers(source: Database, allowed_slots: set[str]) -> tuple[set[str], set[str]]:
    """The source's slots not in ``allowed_slots``, and its publications that are not the migration's."""
    slots, pubs = on_source(source)
    return slots - allowed_slots, {p for p in pubs if not p.startswith(NAME)}


def prepare(source: Database, gid: str, v: int) -> None:
    """A transaction prepared on the source (the fence of ``--prepared wait`` waits for its decision)."""
    with source.connect() as c:
        c.execute("BEGIN")
        c.execute("INSERT INTO acc (v) VALUES (%s)", (v,))
        c.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))


def commit_prepared(source: Database, gid: str) -> None:
    source.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))


def cutover_proc(target: Database, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``applier migrate cutover`` in the background, in its own process group, its output into ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen([*APPLIER, "migrate", "cutover", NAME, "--target", target.dsn, *extra],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def send(proc: subprocess.Popen[bytes], signame: str, group: bool) -> float:
    """Send ``signame`` to ``proc`` (``group``: its whole process group, as systemd, a terminal or ``kill -SIG -PGID``
    do); when it was sent (monotonic)."""
    signum = signal.Signals[signame]
    when = time.monotonic()
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    return when


def wait_fenced(source: Database, cut: subprocess.Popen[bytes], log: Path) -> None:
    """Until the cutover has fenced the source (the database's setting); it must still run then."""
    wait_until(lambda: cut.poll() is not None or read_only(source), timeout=90, interval=0.01,
               what="the cutover to fence the source")  # fmt: skip
    assert cut.poll() is None, f"the cutover ended before its fence was seen:\n{log.read_text()}"


class Writer(threading.Thread):
    """Commits small transactions to the source all along (a row in ``acc``, its ``log`` entry with the sequence's
    next value, a counter in ``items``); a refusal (the fence: read-only, its session ended) is counted and the
    writer connects again a moment later. Only transactions whose COMMIT returned are remembered, by ``acc`` id."""

    def __init__(self, db: Database) -> None:
        super().__init__(daemon=True)
        self.db = db
        self.committed: list[int] = []
        self.refused = 0
        self.last_error = ""
        self.halt = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.halt.is_set():
            try:
                with psycopg.connect(self.db.dsn, autocommit=True, connect_timeout=5) as conn:
                    while not self.halt.is_set():
                        n += 1
                        with conn.transaction():
                            (i,) = conn.execute(
                                "INSERT INTO acc (v) VALUES (%s) RETURNING id", (n,)
                            ).fetchone()  # type: ignore[misc]
                            conn.execute(
                                "INSERT INTO log (acc, note) VALUES (%s, 'w' || nextval('ticket_seq'))", (i,)
                            )
                            conn.execute("UPDATE items SET hits = hits + 1 WHERE k = %s", (1 + n % 2000,))
                        self.committed.append(int(i))
                        # a pace (about 50 transactions a second), not a wait for a condition
                        self.halt.wait(0.01)
            except psycopg.Error as exc:
                self.refused += 1
                self.last_error = str(exc).strip()
                self.halt.wait(0.05)


# --- the schedule ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    """One blow. ``point``: for ``start``, ``setup`` (its schema/copy phase), ``following``, or ``fenced_cutover``
    (while a cutover waits under its fence); for ``cutover``, ``before_fence`` (while its count before the fence
    waits for a transaction open on the source) or ``after_fence`` (while it waits under the fence for a prepared
    transaction). ``delay``: seconds from the point reached to the signal. After a ``kill -9`` of a cutover after its
    fence: ``machine``, whether its ``start`` is killed with it (the machine that ran both lost: nobody is left to
    lift the fence), and ``recovery``, the verb run next (``cutover``, ``start`` again, ``abort``)."""

    victim: str
    point: str
    sig: str
    group: bool
    delay: float
    recovery: str | None = None
    machine: bool = False

    def __str__(self) -> str:
        to = "the process group of" if self.group else "the process"
        text = f"{self.sig} to {to} {self.victim} at {self.point} (+{self.delay:.2f}s)"
        if self.machine:
            text += " with its start"
        return text + (f", then {self.recovery}" if self.recovery else "")


def schedule(seed: int) -> tuple[list[Round], str]:
    """4 to 6 rounds and the final step (``cutover``, ``abort``, or ``aborted``: the last round's recovery was the
    abort). Every schedule has a ``kill -9`` of a cutover after its fence (the blow that leaves the fence up)."""
    rng = random.Random(seed)
    n = rng.randint(4, 6)
    rounds: list[Round] = []
    in_setup = True  # the migration has not been seen following yet: start can be hit in its set-up
    for i in range(n):
        victim = rng.choice(("start", "cutover"))
        if victim == "start":
            points = ["following", "fenced_cutover"] + (["setup", "setup"] if in_setup else [])
        else:
            points = ["before_fence", "after_fence"]
        point = rng.choice(points)
        in_setup = in_setup and point == "setup"
        sig = rng.choice(SIGNALS)
        group = sig == "SIGKILL" or rng.random() < 0.5
        delay = round(rng.uniform(0.0, 0.3 if point == "setup" else 0.4), 2)
        rounds.append(_round(rng, victim, point, sig, group, delay, last=i == n - 1))
    if not any(r.recovery for r in rounds):  # a round that no set-up round follows becomes one
        i = rng.choice([j for j in range(n) if all(r.point != "setup" for r in rounds[j:])] or [n - 1])
        rounds[i] = _round(rng, "cutover", "after_fence", "SIGKILL", True, rounds[i].delay, last=i == n - 1)
    final = (
        "aborted"
        if rounds[-1].recovery == "abort"
        else rng.choice(("cutover", "cutover", "cutover", "abort"))
    )
    return rounds, final


def _round(
    rng: random.Random, victim: str, point: str, sig: str, group: bool, delay: float, *, last: bool
) -> Round:
    if (victim, point, sig) != ("cutover", "after_fence", "SIGKILL"):
        return Round(victim, point, sig, group, delay)
    recovery = rng.choice(("cutover", "start", "abort") if last else ("cutover", "start"))
    return Round(victim, point, sig, group, delay, recovery, machine=rng.random() < 0.5)


# --- the chaos ---------------------------------------------------------------------------------------------------------
class Chaos:
    """The migration's processes and what the rounds check after each blow."""

    def __init__(
        self, pair: Any, started: list[subprocess.Popen[bytes]], tmp_path: Path, writer: Writer
    ) -> None:
        self.pair = pair
        self.pub: Database = pair.publisher
        self.tgt: Database = pair.target
        self.started = started
        self.tmp = tmp_path
        self.writer = writer
        self.logs: list[Path] = []
        self.start_proc: subprocess.Popen[bytes] | None = None
        self.start_log = tmp_path / "start-0.log"
        self.launches = 0
        self.t0 = time.monotonic()
        #: a killed cutover may leave its ``_count`` slot until the next cutover or abort (nothing promised then)
        self.count_slot_may_stay = False
        self.second_start_tried = False
        self.aborted = False

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in self.logs if p.exists())

    # start ------------------------------------------------------------------------------------------------------
    def start_alive(self) -> bool:
        return self.start_proc is not None and self.start_proc.poll() is None

    def launch_start(self) -> float:
        """A new ``start`` once the last one is gone (its lock released, nothing streaming from the slot); when it
        was launched."""
        wait_until(
            lambda: not locked(self.tgt, START_NAMESPACE), timeout=30, what="the last start's lock released"
        )
        self.launches += 1
        self.start_log = self.tmp / f"start-{self.launches}.log"
        self.logs.append(self.start_log)
        launched = time.monotonic()
        self.start_proc = start(self.pair, NAME, log=self.start_log)
        self.started.append(self.start_proc)
        return launched

    def ready(self) -> None:
        """``start`` alive, its migration following (or left in phase ``cutover`` by a cutover killed before its
        fence: the next cutover puts it back) and its worker streaming from the slot, as a cutover needs."""
        p, log = self.start_proc, self.start_log
        assert p is not None

        def ok() -> bool:
            if p.poll() is not None:
                return True
            ph = phase(self.tgt, NAME)
            stale = ph == "cutover" and not locked(self.tgt, CUTOVER_NAMESPACE)
            return (ph == "following" or stale) and settled(self.tgt) and bool(slot_state(self.pub))

        wait_until(ok, timeout=240, interval=0.05, what="start following and streaming")
        assert p.poll() is None, (
            f"start ended (status {p.returncode}) instead of following:\n{log.read_text()}"
        )
        if not self.second_start_tried:  # once: a second start of the migration is refused, the first goes on
            self.second_start_tried = True
            res = subprocess.run([*APPLIER, "migrate", "start", NAME, "--source", self.pub.dsn, "--target", self.tgt.dsn],
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
            assert res.returncode == 1 and "is already run by another applier migrate start" in res.stderr, (
                res
            )
            assert p.poll() is None, log.read_text()
            self.say("a second start was refused; the first goes on")

    def stopped(self, sig: str, since: float) -> None:
        """After a signal to ``start``: a stop signal ends it cleanly (status 0, it says start resumes); then the
        slot is let go (nothing streams from it once start is gone)."""
        p, log = self.start_proc, self.start_log
        assert p is not None
        if sig == "SIGKILL":
            p.wait(timeout=30)
        else:
            status = exit_status(p, log, timeout=90)
            text = log.read_text()
            assert status == 0, f"start stopped by {sig} exited {status}:\n{text}"
            assert "start again resumes" in text, text
        self.say(f"start gone {time.monotonic() - since:.1f}s after the {sig} (status {p.returncode})")
        wait_until(
            lambda: not slot_state(self.pub),
            timeout=30,
            what="nothing streaming from the slot once start is gone",
        )

    def stop_start(self) -> None:
        p = self.start_proc
        assert p is not None
        self.stopped("SIGTERM", send(p, "SIGTERM", False))

    # checks after each blow ---------------------------------------------------------------------------------------
    def only_ours(self) -> None:
        """Nothing on the source but the migration's slot (and a killed cutover's ``_count`` slot) and its
        publications (a slot still held by a walsender whose client died may take a moment to go)."""
        allowed = {NAME} | ({f"{NAME}_count"} if self.count_slot_may_stay else set())
        wait_until(lambda: leftovers(self.pub, allowed) == (set(), set()), timeout=30, interval=0.2,
                   what=f"no slot but {sorted(allowed)} and no other publication on the source")  # fmt: skip

    def backed_out(self, sig: str) -> None:
        """A cutover that backed out: the migration following again with the reason, no fence of its own left."""
        assert phase(self.tgt, NAME) == "following"
        assert fenced_at(self.tgt) is None
        assert sig in error_of(self.tgt) or "start stopped or died" in error_of(self.tgt), error_of(self.tgt)

    # the rounds --------------------------------------------------------------------------------------------------
    def round(self, i: int, r: Round) -> None:
        self.say(f"round {i}: {r}")
        if not self.start_alive():
            self.launch_start()
        if r.victim == "start":
            if r.point == "setup":
                self.start_in_setup(r)
            elif r.point == "following":
                self.ready()
                time.sleep(r.delay)  # the scheduled point: a random moment while following
                self.stopped(r.sig, send(self.start_proc, r.sig, r.group))  # type: ignore[arg-type]
            else:
                self.start_under_a_fence(i, r)
            self.only_ours()  # before start runs again: a resumed copy makes a temporary slot of its own
            self.say(f"round {i} over: phase {phase(self.tgt, NAME)}, slots {sorted(on_source(self.pub)[0])}")
            self.launch_start()  # it must resume: the next round (or the final step) waits for it to follow
            return
        if r.point == "before_fence":
            self.cutover_before_fence(i, r)
        else:
            self.cutover_after_fence(i, r)
        if not self.aborted:
            self.only_ours()
        self.say(f"round {i} over: phase {phase(self.tgt, NAME)}, slots {sorted(on_source(self.pub)[0])}")

    def start_in_setup(self, r: Round) -> None:
        """``start`` hit in its set-up (the phase the signal met is said: the set-up of this small schema takes
        about a second, so a late point may find it following already)."""
        p = self.start_proc
        assert p is not None
        # this start holds its lock (its handlers are installed right after taking it) and the migration has a phase
        wait_until(lambda: p.poll() is not None or (locked(self.tgt, START_NAMESPACE) and phase(self.tgt, NAME)),
                   timeout=120, interval=0.01, what="start to begin its set-up")  # fmt: skip
        assert p.poll() is None, self.start_log.read_text()
        time.sleep(r.delay)  # the scheduled point: a random moment of the set-up
        at = phase(self.tgt, NAME)
        since = send(p, r.sig, r.group)
        self.say(f"{r.sig} to start in phase {at}")
        self.stopped(r.sig, since)
        self.say(
            f"source writable {writable_within(self.pub, since, f'the {r.sig} to start'):.1f}s after the signal"
        )

    def fenced_cutover(self, i: int) -> tuple[str, Path, subprocess.Popen[bytes]]:
        """A cutover (``--prepared wait``) waiting under its fence for a prepared transaction of round ``i``: the
        transaction's GID, the cutover's log and process."""
        self.ready()
        gid = f"chaos_{i}"
        prepare(self.pub, gid, 100000 + i)
        log = self.tmp / f"cutover-{i}.log"
        self.logs.append(log)
        cut = cutover_proc(self.tgt, log, "--prepared", "wait", "--timeout", "60")
        self.started.append(cut)
        wait_fenced(self.pub, cut, log)
        return gid, log, cut

    def start_under_a_fence(self, i: int, r: Round) -> None:
        """``start`` hit while a cutover waits under its fence for a prepared transaction: the cutover sees start
        gone within its next look, backs out (exit 1) and unfences."""
        gid, log, cut = self.fenced_cutover(i)
        time.sleep(r.delay)  # the scheduled point: a random moment under the fence
        since = send(self.start_proc, r.sig, r.group)  # type: ignore[arg-type]
        try:
            status = cut.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the cutover did not end within 15s of the {r.sig} to start:\n{log.read_text()}")
        took = time.monotonic() - since
        out = log.read_text()
        assert status == 1 and "start stopped or died during the cutover" in out, out
        assert "the source is unfenced" in out, out
        self.say(f"the cutover backed out {took:.1f}s after the {r.sig} to start")
        self.say(
            f"source writable {writable_within(self.pub, since, f'the {r.sig} to start'):.1f}s after the signal"
        )
        self.backed_out(r.sig)
        self.stopped(r.sig, since)
        commit_prepared(self.pub, gid)

    def cutover_before_fence(self, i: int, r: Round) -> None:
        """The cutover hit while its count before the fence waits (the ``_count`` slot's creation waits for a
        transaction open on the source): it has fenced nothing."""
        self.ready()
        log = self.tmp / f"cutover-{i}.log"
        self.logs.append(log)
        with self.pub.connect() as blocker:
            blocker.execute("BEGIN")
            blocker.execute("INSERT INTO items (k, payload) VALUES (%s, 'open at the count')", (-i,))
            cut = cutover_proc(self.tgt, log, "--prepared", "wait", "--timeout", "60")
            self.started.append(cut)
            wait_until(lambda: cut.poll() is not None or self.pub.scalar(
                           "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                           " AND application_name = 'applier migrate count' AND wait_event_type = 'Lock'"),
                       timeout=90, interval=0.01, what="the cutover's count to wait for the open transaction")  # fmt: skip
            assert cut.poll() is None, log.read_text()
            assert (
                phase(self.tgt, NAME) == "cutover" and fenced_at(self.tgt) is None and not read_only(self.pub)
            )
            time.sleep(r.delay)  # the scheduled point: a random moment of that wait
            since = send(cut, r.sig, r.group)
            try:  # the open transaction stays open until the cutover has ended: it must end on the signal alone
                status = cut.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the cutover did not end within 30s of {r.sig}:\n{log.read_text()}")
            took = time.monotonic() - since
            blocker.execute("COMMIT")
        out = log.read_text()
        self.say(f"cutover ended {took:.1f}s after the {r.sig} (status {status})")
        if r.sig == "SIGKILL":
            self.count_slot_may_stay = True
        else:
            assert status == 128 + signal.Signals[r.sig], out
            assert f"cutover interrupted by {r.sig}" in out, out
            self.backed_out(r.sig)
        assert fenced_at(self.tgt) is None
        self.say(
            f"source writable {writable_within(self.pub, since, f'the {r.sig} to the cutover'):.1f}s after the signal"
        )
        assert self.start_alive(), self.start_log.read_text()

    def cutover_after_fence(self, i: int, r: Round) -> None:
        """The cutover hit under its fence, waiting for a prepared transaction (``--prepared wait``)."""
        gid, log, cut = self.fenced_cutover(i)
        assert fenced_at(self.tgt) is not None, (
            "the source is fenced, and the migration's record does not say so"
        )
        time.sleep(r.delay)  # the scheduled point: a random moment under the fence
        if r.machine:  # start first: killed alone, it would make the cutover back out at its next look
            send(self.start_proc, "SIGKILL", True)  # type: ignore[arg-type]
        since = send(cut, r.sig, r.group)
        try:
            status = cut.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the cutover did not end within 30s of {r.sig}:\n{log.read_text()}")
        out = log.read_text()
        self.say(f"cutover ended {time.monotonic() - since:.1f}s after the {r.sig} (status {status})")
        if r.sig != "SIGKILL":
            assert status == 128 + signal.Signals[r.sig], out
            assert f"cutover interrupted by {r.sig}" in out, out
            took = writable_within(self.pub, since, f"the {r.sig} to the cutover")
            self.say(f"source writable {took:.1f}s after the signal")
            self.backed_out(r.sig)
        else:
            self.count_slot_may_stay = True  # a killed cutover's _count slot: until the next cutover or abort
            if r.machine:
                self.start_proc.wait(timeout=30)  # type: ignore[union-attr]
                # nobody left to lift it: the fence stays, recorded, until the migration's next verb
                assert read_only(self.pub) and not writable(self.pub) and fenced_at(self.tgt) is not None
            else:  # the following start lifts what a dead cutover left, within seconds
                took = writable_within(self.pub, since, "the kill -9 of the cutover (start following)")
                self.say(f"source writable {took:.1f}s after the kill (start lifted the fence)")
                assert self.start_alive(), self.start_log.read_text()
            self.recover(i, r)
        commit_prepared(self.pub, gid)

    def recover(self, i: int, r: Round) -> None:
        """After a ``kill -9`` of a cutover under its fence (its prepared transaction still open): the scheduled
        verb; when the fence is still up (``machine``: start killed too) it lifts it first."""
        fenced = fenced_at(self.tgt) is not None
        lifted = "source unfenced (fenced by this migration at"
        alive = self.start_alive()
        if r.recovery == "start":
            if alive:
                self.stop_start()
            since = self.launch_start()
            what = "start again"
        else:
            # a cutover of the migration is refused while the killed one's target session still holds its lock
            wait_until(lambda: not locked(self.tgt, CUTOVER_NAMESPACE), timeout=30,
                       what="the killed cutover's lock released")  # fmt: skip
            since = time.monotonic()
            if r.recovery == "cutover":
                # with start alive, the prepared transaction still open makes it fence, wait 5 s and back out
                res = migrate(self.tgt, "cutover", NAME, "--prepared", "wait", "--timeout", "5")
                what = "the next cutover"
            else:
                res = migrate(self.tgt, "abort", NAME)
                what = "the abort"
            out = res.stdout + res.stderr
            self.logs.append(self.tmp / f"recovery-{i}.log")
            self.logs[-1].write_text(out)
            if fenced:
                assert lifted in res.stdout, out
            if r.recovery == "abort":
                assert res.returncode == 0, out
            elif alive:
                assert res.returncode == 1, out
                assert (
                    "prepared transaction(s) on the source were not decided within the timeout" in res.stderr
                ), out
                self.count_slot_may_stay = False
            else:
                assert res.returncode == 1 and "no applier migrate start is running" in res.stderr, out
                assert "nothing was fenced" in res.stderr, out
        took = writable_within(self.pub, since, what)
        self.say(
            f"source writable {took:.1f}s after {what} began{' (it lifted the fence)' if fenced else ''}"
        )
        if r.recovery == "abort":
            self.aborted_checks(alive)
            return
        assert fenced_at(self.tgt) is None
        if not self.start_alive():
            self.launch_start()

    def aborted_checks(self, start_was_alive: bool) -> None:
        """After an abort: a running start stopped (status 1), nothing of the migration left on the source."""
        self.aborted = True
        p = self.start_proc
        if p is not None and start_was_alive:
            status = exit_status(p, self.start_log, timeout=60)
            assert status == 1, (
                f"start exited {status} once its migration was aborted:\n{self.start_log.read_text()}"
            )
        assert phase(self.tgt, NAME) == "failed" and fenced_at(self.tgt) is None
        wait_until(lambda: on_source(self.pub) == (set(), set()), timeout=30, interval=0.2,
                   what="no slot and no publication left on the source after the abort")  # fmt: skip

    # the final step ----------------------------------------------------------------------------------------------
    def final(self, step: str) -> None:
        self.say(f"final: {step}")
        if step == "aborted":
            assert self.aborted
            assert writable(self.pub)
            return
        if not self.start_alive():
            self.launch_start()
        if step == "abort":
            since = time.monotonic()
            res = migrate(self.tgt, "abort", NAME)
            assert res.returncode == 0, res.stdout + res.stderr
            self.say(
                f"source writable {writable_within(self.pub, since, 'the abort'):.1f}s after the abort began"
            )
            self.aborted_checks(True)
            return
        self.ready()
        res = migrate(self.tgt, "cutover", NAME, "--prepared", "wait", "--timeout", "90", timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "cutover done: write downtime" in res.stdout, res.stdout
        self.say(res.stdout.strip().splitlines()[-1])
        assert exit_status(self.start_proc, self.start_log) == 0, self.start_log.read_text()  # type: ignore[arg-type]
        self.writer.halt.set()
        self.writer.join(timeout=30)
        assert phase(self.tgt, NAME) == "done"
        assert_tables_equal(self.pub, self.tgt, *TABLES)
        on_target = {r[0] for r in self.tgt.query("SELECT id FROM acc")}
        lost = set(self.writer.committed) - on_target
        assert not lost, (
            f"{len(lost)} committed row(s) of the writer missing on the target: {sorted(lost)[:10]}"
        )
        for seq in ("ticket_seq", "acc_id_seq", "log_id_seq"):  # the target's next values follow the source's
            assert self.tgt.scalar(sql.SQL("SELECT nextval({})").format(sql.Literal(seq))) > self.pub.scalar(
                sql.SQL("SELECT last_value FROM {}").format(sql.Identifier(seq))
            )
        wait_until(lambda: on_source(self.pub) == (set(), set()), timeout=30, interval=0.2,
                   what="no slot and no publication left on the source after the cutover")  # fmt: skip


@pytest.mark.slow
def test_kill_and_signal_the_migration_verbs_at_random_points(pair, procs, tmp_path) -> None:
    seed = int(os.environ.get("APPLIER_CHAOS_SEED") or DEFAULT_SEED)
    rounds, final = schedule(seed)
    print(f"\nAPPLIER_CHAOS_SEED={seed}: {len(rounds)} rounds, then {final}", flush=True)
    for i, r in enumerate(rounds, 1):
        print(f"  round {i}: {r}", flush=True)
    pair.publisher.execute(SCHEMA)
    writer = Writer(pair.publisher)
    writer.start()
    wait_until(lambda: len(writer.committed) >= 20, timeout=60, what="the writer's first commits")
    chaos = Chaos(pair, procs, tmp_path, writer)
    chaos.launch_start()
    try:
        for i, r in enumerate(rounds, 1):
            chaos.round(i, r)
        chaos.final(final)
    except BaseException:
        print(f"\nAPPLIER_CHAOS_SEED={seed} failed; the verbs' output:\n{chaos.tails()}", flush=True)
        raise
    finally:
        writer.halt.set()
        writer.join(timeout=30)
    chaos.say(f"done: the writer committed {len(writer.committed)} transaction(s), {writer.refused} refused")
    assert len(writer.committed) > 100


# --- deterministic ---------------------------------------------------------------------------------------------------
def _fenced_cutover(
    pair: Any, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> tuple[subprocess.Popen[bytes], Path, subprocess.Popen[bytes], Path]:
    """``start`` following; a cutover (``--prepared wait``) waiting under its fence for the prepared transaction
    ``held``: start's process and log, the cutover's process and log."""
    proc, log = following(pair, started, tmp_path, SCHEMA)
    wait_until(lambda: slot_state(pair.publisher), timeout=60, what="the worker streaming from the slot")
    prepare(pair.publisher, "held", 777)
    cut_log = tmp_path / "cutover.log"
    cut = cutover_proc(pair.target, cut_log, "--prepared", "wait", "--timeout", "60")
    started.append(cut)
    wait_fenced(pair.publisher, cut, cut_log)
    return proc, log, cut, cut_log


@pytest.mark.core
@pytest.mark.anyversion  # our fence's record and recovery
def test_a_cutover_killed_under_its_fence_shows_in_status_and_abort_lifts_it(pair, procs, tmp_path) -> None:
    """The machine that ran ``start`` and the cutover is lost under the fence (both ``kill -9``, start first: alone,
    it would make the cutover back out; the cutover alone, start would lift its fence): the fence stays, and
    ``status`` says it is this migration's; ``abort`` from elsewhere lifts it."""
    pub, tgt = pair.publisher, pair.target
    proc, _, cut, _ = _fenced_cutover(pair, procs, tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    os.killpg(cut.pid, signal.SIGKILL)
    proc.wait()
    cut.wait()
    res = migrate(tgt, "status", NAME, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["fence"]["fenced_at"] is not None and doc["fence"]["source_read_only"] is True, doc["fence"]
    assert not writable(pub)  # nobody lifted it: the fence stays until the migration's next verb
    since = time.monotonic()
    res = migrate(tgt, "abort", NAME)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "source unfenced" in res.stdout, res.stdout
    writable_within(pub, since, "the abort")
    pub.execute("COMMIT PREPARED 'held'")
    assert fenced_at(tgt) is None and phase(tgt, NAME) == "failed"
    wait_until(lambda: on_source(pub) == (set(), set()), timeout=30, what="nothing of the migration left")


@pytest.mark.core
@pytest.mark.anyversion  # our cutover's look at start while it waits
def test_a_cutover_waiting_under_its_fence_backs_out_when_start_stops(pair, procs, tmp_path) -> None:
    pub, tgt = pair.publisher, pair.target
    proc, log, cut, cut_log = _fenced_cutover(pair, procs, tmp_path)
    since = send(proc, "SIGTERM", False)  # start alone (its process group: the chaos test)
    try:
        status = cut.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the cutover did not end within 15s of start's SIGTERM:\n{cut_log.read_text()}")
    out = cut_log.read_text()
    assert status == 1 and "applier migrate start stopped or died during the cutover" in out, out
    assert "the source is unfenced" in out, out
    assert writable(pub), f"the source is still fenced {time.monotonic() - since:.1f}s after start's SIGTERM"
    assert exit_status(proc, log) == 0, log.read_text()
    assert phase(tgt, NAME) == "following" and fenced_at(tgt) is None
    pub.execute("COMMIT PREPARED 'held'")
