"""``kill -9`` of the applier at random points of a random workload, then a restart: nothing lost, nothing applied
twice, no prepared transaction stranded.

The applier runs as users run it, ``python -m applier.cli --target DSN run NAME``, in its own process group, so a
kill takes the ``run`` parent and its worker process down at once, wherever they are: mid-transaction, between a
local PREPARE and its bookkeeping, while spooling a streamed transaction, while replaying one, between a COMMIT
and the feedback that reports it. Hypothesis draws the workload (:func:`applier.testing.workloads.workloads`, with
prepared transactions in every example, some large enough to stream at the publisher's 64kB
``logical_decoding_work_mem``) and a kill schedule: at which workload steps a kill is armed, how many milliseconds
later it fires (from a timer thread, while the workload goes on), and how many more steps run while the applier is
down (a backlog for the restart). Optionally one more kill lands while the restarted applier works through that
backlog. The subscription streams and has two-phase enabled, so every kind of state is in play.

After the last restart the applier must catch up; then the target must equal the publisher row by row, hold
exactly the keys the workload's model predicts (nothing lost; each once, which the keyless REPLICA IDENTITY FULL
table would not refuse on its own) and have no prepared transaction left (``assert_replica``). A failure prints
the workload as SQL, the kill schedule and the tail of the applier's log.

Kill timing is real time, so an example cannot be replayed exactly: the test runs hypothesis' generate phase only
(no shrinking, which would chase timing). Profiles: ``FAST_EXAMPLES`` examples under hypothesis' ``default``
profile and any other but ``long`` (each kill costs a cold start of ``applier run``, a few seconds here); under
``long``, that profile's ``max_examples`` (see ``tests/integration/test_apply_property.py`` for how to select it).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from applier.testing import PostgresCluster, wait_until
from applier.testing.pytest_plugin import ReplicationPair
from applier.testing.workloads import TABLES, Workload, create_schema, run_workload, workloads
from tests.support.tap import (
    TIMEOUT,
    CliApplier,
    assert_replica,
    catchup,
    fresh_subscription,
    module_pair,
    set_decoding_work_mem,
    walsender_pid,
)

FAST_EXAMPLES = 3
MAX_ACTIONS = 30
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]

_counter = itertools.count(1)


@dataclass(frozen=True)
class Kill:
    """Arm a kill before workload step ``at`` (modulo the number of steps); it fires ``delay_ms`` later; the
    applier is restarted before step ``at + down_steps`` (or after the workload)."""

    at: int
    delay_ms: int
    down_steps: int


kills = st.builds(Kill, at=st.integers(0, 10_000), delay_ms=st.integers(0, 400), down_steps=st.integers(0, 4))


def example_settings() -> settings:
    """Generate-only; bounded unless the ``long`` profile is active, then that profile's size."""
    phases = [Phase.explicit, Phase.generate]
    if settings.get_current_profile_name() != "long":  # also hypothesis' own "ci" profile (CI=true)
        return settings(
            max_examples=FAST_EXAMPLES, phases=phases, deadline=None, suppress_health_check=_HEALTH
        )
    return settings(settings.default, phases=phases, deadline=None, suppress_health_check=_HEALTH)


@pytest.fixture(scope="module")
def workload_pair(
    publisher_cluster: PostgresCluster, target_cluster: PostgresCluster
) -> Iterator[ReplicationPair]:
    with module_pair(publisher_cluster, target_cluster, "crash") as pair:
        set_decoding_work_mem(pair.publisher)
        create_schema(pair.publisher, pair.target)
        yield pair


class Killer:
    """Runs ``applier run`` and kills it on a timer, restarting it when the schedule says so."""

    def __init__(self, pair: ReplicationPair, applier: CliApplier) -> None:
        self.pair = pair
        self.applier = applier
        self.timer: threading.Timer | None = None
        self.kills = 0
        self.killed_walsender: int | None = None

    def start(self) -> None:
        self.applier.start()

    def wait_streaming(self) -> None:
        """Kill a working applier, not one still starting: wait for its walsender (a new one: the killed
        applier's walsender may linger until it notices its client is gone)."""
        wait_until(
            lambda: (
                walsender_pid(self.pair.publisher, self.applier.subname) not in (None, self.killed_walsender)
            ),
            timeout=TIMEOUT,
            what="the applier to stream",
        )

    def arm(self, delay_ms: int) -> None:
        self.killed_walsender = walsender_pid(self.pair.publisher, self.applier.subname)
        self.timer = threading.Timer(delay_ms / 1000, self.applier.kill9)
        self.timer.start()
        self.kills += 1

    def restart(self) -> None:
        """Make sure the armed kill has happened, then start the applier again."""
        if self.timer is not None:
            self.timer.join()
            self.timer = None
        self.applier.kill9()  # no-op if the timer's kill already happened
        self.applier.start()


def run_with_kills(
    pair: ReplicationPair, workload: Workload, schedule: list[Kill], final_kill: int | None
) -> None:
    name = f"{pair.name[:40]}_{next(_counter)}"
    with (
        fresh_subscription(pair, name, list(TABLES), two_phase_state="e", streaming="on") as _setup,
        CliApplier(pair.target, name) as applier,
    ):
        killer = Killer(pair, applier)
        steps = len(workload.steps) or 1
        arm_at = {k.at % steps: k for k in schedule}
        restart_at: dict[int, bool] = {}
        killer.start()
        try:
            killer.wait_streaming()

            def on_step(index: int) -> None:
                if index in restart_at:
                    del restart_at[index]
                    killer.restart()
                    killer.wait_streaming()
                kill = arm_at.get(index)
                if kill is not None and killer.timer is None and not restart_at:
                    killer.arm(kill.delay_ms)
                    restart_at[index + max(1, kill.down_steps)] = True

            run_steps(pair, workload, on_step)
            if restart_at or killer.timer is not None:
                killer.restart()
            if final_kill is not None:  # one more, while it works through what piled up
                killer.wait_streaming()
                killer.arm(final_kill)
                killer.restart()
            catchup(pair.publisher, name)
            assert applier.alive, "applier run exited"
            assert_replica(pair, workload)
        except BaseException:
            print(f"--- kills: {killer.kills}; applier log tail:\n{applier.log_tail(80)}")
            raise


def run_steps(pair: ReplicationPair, workload: Workload, before_step: object) -> None:
    """:func:`run_workload`, calling ``before_step(index)`` before each step (the kill schedule's clock)."""
    index = itertools.count()
    before_step(next(index))  # type: ignore[operator]
    run_workload(pair.publisher, workload, on_step=lambda _step: before_step(next(index)))  # type: ignore[operator]


@pytest.mark.core
@pytest.mark.anyversion  # exactly-once after kill -9 is the origin's and our commit order, not the server version's
def test_kill9_at_random_points_loses_nothing_and_applies_nothing_twice(
    workload_pair: ReplicationPair,
) -> None:
    @example_settings()
    @given(
        workload=workloads(max_actions=MAX_ACTIONS, min_prepared=2, min_actions=6),
        schedule=st.lists(kills, min_size=1, max_size=3),
        final_kill=st.none() | st.integers(0, 600),
    )
    def prop(workload: Workload, schedule: list[Kill], final_kill: int | None) -> None:
        note(f"kill schedule: {schedule}, then {final_kill} ms into the catch-up")
        note(f"workload ({len(workload.steps)} steps):\n{workload.to_sql()}")
        try:
            run_with_kills(workload_pair, workload, schedule, final_kill)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n-- kill schedule: {schedule}, final {final_kill}\n-- workload:\n{workload.to_sql()}"
            ) from exc

    prop()
