"""Random valid message sequences through the apply core never leave it in a state that contradicts what it sent
the target: every local transaction begun is ended exactly once, the replication origin only moves forward, each
remote transaction is committed at most once, and what ends up committed (or left prepared) is exactly what the
publisher committed (or left prepared), minus what PostgreSQL's worker would not apply either (the skip-LSN's
transaction, changes of a table not ready, a rolled back subtransaction of a streamed one)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from applier.apply.fold import Decision
from applier.messages import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Insert,
    Prepare,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Update,
)
from applier.testing.fake_target import Call
from state.twophase import gid_for
from tests.support.applier_kit import REL_T, REL_U, U, make_core, row

#: how a remote transaction ends: plain commit; prepared, then committed / rolled back / left prepared; streamed,
#: then committed / aborted / prepared and committed
KINDS = ("plain", "prepare_commit", "prepare_rollback", "prepare_left", "stream_commit", "stream_abort",
         "stream_prepare")  # fmt: skip
SUBID = 7


@dataclass
class Spec:
    kind: str
    changes: list[int]  # the relid (1 or 2) of each change
    folded: bool = (
        False  # its decision comes right after its PREPARE and the batch knows it (applier.apply.fold)
    )
    delay: int = 0  # transactions between the PREPARE and its decision
    abort_subxact: bool = False  # streamed: a second chunk from a subtransaction that is rolled back


@dataclass
class Run:
    """The messages of a generated history and what the target must end with."""

    messages: list[object] = field(default_factory=list)
    #: rows committed by the publisher that the target must hold: (relid, xid, position)
    committed: set[tuple[int, int, int]] = field(default_factory=set)
    #: rows of transactions left prepared, by local GID
    prepared: dict[str, set[tuple[int, int, int]]] = field(default_factory=dict)
    decided: dict[int, Decision] = field(default_factory=dict)
    final_lsns: list[int] = field(default_factory=list)


specs = st.builds(
    Spec,
    st.sampled_from(KINDS),
    st.lists(st.sampled_from((1, 2)), max_size=4),
    st.booleans(),
    st.integers(0, 2),
    st.booleans(),
)


def change(relid: int, xid: int, i: int, sub: int | None) -> object:
    """An Insert, or for odd positions an Update, tagged with its transaction and position."""
    tup = row(xid, i) if relid == 1 else row(xid * 100 + i)
    if relid == 1 and i % 2:
        return Update(sub, relid, None, None, tup)
    return Insert(sub, relid, tup)


def tag(relid: int, tup: object) -> tuple[int, int, int]:
    values = [int(v) for v in tup.values]  # type: ignore[attr-defined]
    return (relid, values[0], values[1]) if relid == 1 else (relid, values[0] // 100, values[0] % 100)


def build(history: list[Spec], skip_index: int | None, u_ready: bool) -> tuple[Run, int]:
    """Turn the specs into messages with LSNs that grow in emission order; returns the run and the skip-LSN."""
    run = Run(messages=[REL_T, REL_U])
    lsn = 0
    skip_lsn = 0
    pending: list[tuple[int, object]] = []  # (transactions still to wait, decision message)

    def next_lsn() -> int:
        nonlocal lsn
        lsn += 100
        return lsn

    def rows_of(relids: list[int], xid: int) -> set[tuple[int, int, int]]:
        return {(r, xid, i) for i, r in enumerate(relids) if u_ready or r == 1}

    for n, spec in enumerate(history):
        xid = 1000 + n
        final = next_lsn()
        run.final_lsns.append(final)
        skipped = n == skip_index
        if skipped:
            skip_lsn = final
        rows = set() if skipped else rows_of(spec.changes, xid)
        body = [change(r, xid, i, None) for i, r in enumerate(spec.changes)]
        if spec.kind == "plain":
            run.messages += [Begin(final, 1, xid), *body, Commit(0, final, final + 8, 2)]
            run.committed |= rows
        elif spec.kind.startswith("prepare"):
            gid = gid_for(SUBID, xid)
            run.messages += [
                BeginPrepare(final, final + 8, 3, xid, "p"),
                *body,
                Prepare(0, final, final + 8, 3, xid, "p"),
            ]
            if spec.kind == "prepare_left":
                run.prepared[gid] = rows
            else:
                commit = spec.kind == "prepare_commit"
                (run.committed if commit else set()).update(rows)
                decision = (
                    CommitPrepared(0, 0, 0, 4, xid, "p") if commit else RollbackPrepared(0, final + 8, 0, 3, 4, xid, "p")
                )  # fmt: skip
                if spec.folded:  # the decision is the very next message
                    run.decided[xid] = Decision(final + 8, 3, commit)
                    run.messages.append(at_lsn(decision, next_lsn()))
                else:
                    pending.append((spec.delay, decision))
        else:
            chunk = [dataclasses.replace(c, xid=xid) for c in body]  # type: ignore[type-var]
            run.messages += [
                StreamStart(xid, True),
                dataclasses.replace(REL_T, xid=xid),
                *chunk,
                StreamStop(),
            ]
            if spec.abort_subxact:
                sub = [change(1, xid, 90, xid + 500)]
                run.messages += [StreamStart(xid, False), *sub, StreamStop(), StreamAbort(xid, xid + 500)]
            final = next_lsn()  # the stream's end comes later in the WAL
            run.final_lsns[-1] = final
            if skipped:
                skip_lsn = final
            if spec.kind == "stream_commit":
                run.messages.append(StreamCommit(xid, 0, final, final + 8, 2))
                run.committed |= rows
            elif spec.kind == "stream_abort":
                run.messages.append(StreamAbort(xid, xid))
                run.final_lsns.pop()
                if skipped:
                    skip_lsn = 0  # nothing of it is ever applied: the skip-LSN stays
            else:
                run.messages.append(StreamPrepare(0, final, final + 8, 3, xid, "p"))
                run.committed |= rows
                pending.append((0, CommitPrepared(0, 0, 0, 4, xid, "p")))
        # decisions whose time has come, with LSNs in emission order
        due = [d for d in pending if d[0] == 0]
        pending = [(k - 1, d) for k, d in pending if k > 0]
        run.messages += [at_lsn(decision, next_lsn()) for _k, decision in due]
    run.messages += [at_lsn(decision, next_lsn()) for _k, decision in pending]  # the rest at the end
    return run, skip_lsn


def at_lsn(decision: object, at: int) -> object:
    """A COMMIT PREPARED / ROLLBACK PREPARED placed at ``at`` in the WAL."""
    if isinstance(decision, CommitPrepared):
        return dataclasses.replace(decision, commit_lsn=at, end_lsn=at + 8)
    return dataclasses.replace(decision, rollback_end_lsn=at + 8)  # type: ignore[type-var]


def replay(calls: list[Call]) -> tuple[set[tuple[int, int, int]], dict[str, set[tuple[int, int, int]]]]:
    """What the target holds after these calls: committed rows, and rows of each prepared transaction. Checks on
    the way that local transactions begin and end in turn and that no remote transaction commits twice."""
    committed: set[tuple[int, int, int]] = set()
    prepared: dict[str, set[tuple[int, int, int]]] = {}
    open_rows: set[tuple[int, int, int]] | None = None
    finished_xids: list[int] = []
    relids = {"public.t": 1, "public.u": 2}
    for c in calls:
        if c.name == "begin":
            assert open_rows is None, "BEGIN inside an open local transaction"
            open_rows = set()
        elif c.name in ("insert", "update"):
            assert open_rows is not None
            open_rows.add(tag(relids[c.args[0]], c.args[-1]))
        elif c.name in ("commit", "prepare"):
            assert open_rows is not None, f"{c.name} without a local transaction"
            if c.name == "commit":
                committed |= open_rows
            else:
                prepared[c.args[0]] = open_rows
            finished_xids.append(c.ctx.xid)  # type: ignore[union-attr]
            open_rows = None
        elif c.name in ("commit_prepared", "rollback_prepared"):
            assert open_rows is None
            rows = prepared.pop(c.args[0])
            if c.name == "commit_prepared":
                committed |= rows
            finished_xids.append(c.ctx.xid)  # type: ignore[union-attr]
    assert open_rows is None, "a local transaction was left open"
    # a remote xid ends at most twice: PREPARE, then COMMIT/ROLLBACK PREPARED; a plain one once
    assert all(finished_xids.count(x) <= 2 for x in finished_xids)
    return committed, prepared


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    history=st.lists(specs, max_size=8),
    group_commit=st.booleans(),
    skip=st.booleans(),
    u_ready=st.booleans(),
)
def test_random_histories_end_consistently(tmp_path: Path, history, group_commit, skip, u_ready):
    # the skip-LSN names the first transaction: a later one would be cleared first, as mistaken, by any earlier
    # transaction that applies something (behaviour 100; test_applier_core covers that)
    run, skip_lsn = build(history, 0 if skip else None, u_ready)
    core = make_core(
        tmp_path / f"spool-{id(run)}", skip_lsn=skip_lsn, not_ready={} if u_ready else {U.oid: 0},
        group_commit=group_commit,
    )  # fmt: skip
    core.applier.decided = dict(run.decided)
    core.feed_all(run.messages)
    core.applier.end_group()
    core.target.confirm_all()

    assert core.applier.idle and not core.applier.group_pending and not core.tracker.holding
    assert not core.target.in_transaction
    positions = core.target.origin_positions
    assert positions == sorted(set(positions)), "the origin moved backwards or repeated a position"
    committed, prepared = replay(core.target.calls)
    assert committed == run.committed
    assert prepared == run.prepared
    assert set(core.applier.prepared) == set(run.prepared)
    if skip_lsn and core.applier.transactions:
        assert core.skip.skip_lsn == 0
