"""Property: whatever the publisher does, once the applier has caught up the target holds exactly the publisher's
rows, and no prepared transaction of ours is left behind.

Hypothesis draws an example of two to four *rounds*, each a workload from
:func:`applier.testing.workloads.workloads` (up to three interleaved sessions; inserts, updates, key changes and
deletes on a primary-key table with TOASTed values, a REPLICA IDENTITY FULL table without a key and a REPLICA
IDENTITY USING INDEX table; savepoints, some rolled back to; transactions committed, rolled back, or prepared and
later committed or rolled back prepared, at least one prepared per round; truncates; bulk inserts of 200-3000
rows), and the subscription's options (two-phase on or off, streaming on or off, binary or text). The rounds run on
the publisher one after the other under one subscription while our applier (a worker thread) applies them; after
each round the applier must catch up and the target must equal the publisher row by row (``assert_tables_equal``
over ``TABLES``: a duplicate in the keyless table would show), hold exactly the keys the round's model predicts,
and have nothing left in ``pg_prepared_xacts``. The publisher then empties the tables (a replicated TRUNCATE) for
the next round. Rounds exist because ``workloads()`` draws short workloads (a handful of statements, most often):
several per example give the applier a longer history at the cost of one subscription set-up.

The publisher database decodes with ``logical_decoding_work_mem = 64kB``, so the bulk inserts stream when the
subscription streams (and spill to disk on the publisher when it does not).

Each example gets a fresh subscription (publication, slot, catalog rows, origin) on a pair of databases shared by
the module, emptied first. A failing example is shrunk and printed as one SQL script (``Workload.to_sql()`` of
each round, separated by the TRUNCATE), with the subscription options, ready for psql.

Profiles. Unless the ``long`` profile is active the run is bounded and reproducible (also under hypothesis' own
``ci`` profile, which it selects when ``CI`` is set): ``FAST_EXAMPLES`` derandomized examples of rounds of at most
``FAST_ACTIONS`` actions, well under a minute on a loaded 2-core machine. Under ``long`` the test uses that
profile's ``max_examples`` (and randomness) and longer rounds. ``tests/unit/conftest.py`` registers ``long`` (hypothesis
loads the profile named by ``--hypothesis-profile`` before test modules are imported), so
``--hypothesis-profile=long`` just works; the settings are chosen when the test runs, not at import.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from applier.testing import PostgresCluster
from applier.testing.pytest_plugin import ReplicationPair
from applier.testing.workloads import TABLES, Workload, create_schema, run_workload, workloads
from tests.support.tap import assert_replica, catchup, fresh_subscription, module_pair, set_decoding_work_mem

FAST_EXAMPLES = 10
FAST_ACTIONS = 30
LONG_ACTIONS = 80
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]

_counter = itertools.count(1)


def example_settings() -> tuple[settings, int]:
    """(settings, max actions) for this run: bounded and derandomized unless the ``long`` profile was chosen
    (hypothesis switches to its own ``ci`` profile when ``CI`` is set: that must stay bounded too), the active
    profile's otherwise. Read at run time, after ``--hypothesis-profile`` was applied."""
    if settings.get_current_profile_name() != "long":
        fast = settings(
            max_examples=FAST_EXAMPLES, derandomize=True, deadline=None, suppress_health_check=_HEALTH
        )
        return fast, FAST_ACTIONS
    return settings(settings.default, deadline=None, suppress_health_check=_HEALTH), LONG_ACTIONS


@pytest.fixture(scope="module")
def workload_pair(
    publisher_cluster: PostgresCluster, target_cluster: PostgresCluster
) -> Iterator[ReplicationPair]:
    """The workload schema on a publisher database decoding with 64kB, and on a target database."""
    with module_pair(publisher_cluster, target_cluster, "property") as pair:
        set_decoding_work_mem(pair.publisher)
        create_schema(pair.publisher, pair.target)
        yield pair


#: what separates the rounds of an example: the model of each round starts from empty tables
TRUNCATE_ALL = "TRUNCATE " + ", ".join(TABLES)


def script(rounds: list[Workload]) -> str:
    """The example as one psql script (what a failure prints)."""
    return f"\n{TRUNCATE_ALL};\n".join(w.to_sql() for w in rounds)


def replicate(pair: ReplicationPair, rounds: list[Workload], options: dict[str, object], spool: Path) -> None:
    """Run the rounds under a fresh subscription with ``options``; after each, the applier catches up and the
    replica is checked, then the publisher empties the tables (replicated too) for the next round."""
    name = f"{pair.name[:40]}_{next(_counter)}"
    with fresh_subscription(pair, name, list(TABLES), **options) as setup:
        worker = setup.start(spool_dir=spool)
        try:
            for i, workload in enumerate(rounds):
                if i:
                    pair.publisher.execute(TRUNCATE_ALL)  # noqa: S608 - fixed table names
                run_workload(pair.publisher, workload)
                catchup(pair.publisher, name)
                assert worker.alive, f"the worker ended: {worker.worker.stats.last_error}"
                try:
                    assert_replica(pair, workload)
                except AssertionError as exc:
                    raise AssertionError(f"after round {i + 1} of {len(rounds)}: {exc}") from exc
        finally:
            worker.stop()


@pytest.mark.core
def test_random_workloads_replicate_exactly(workload_pair: ReplicationPair, tmp_path: Path) -> None:
    chosen, max_actions = example_settings()

    @chosen
    @given(
        rounds=st.lists(workloads(max_actions=max_actions, min_prepared=1), min_size=2, max_size=4),
        two_phase=st.sampled_from(["e", "d"]),
        streaming=st.sampled_from(["on", "off"]),
        binary=st.booleans(),
    )
    def prop(rounds: list[Workload], two_phase: str, streaming: str, binary: bool) -> None:
        options = {"two_phase_state": two_phase, "streaming": streaming, "binary": binary}
        note(f"subscription options: {options}")
        note(
            f"workload ({sum(len(w.steps) for w in rounds)} steps in {len(rounds)} rounds):\n{script(rounds)}"
        )
        try:
            replicate(workload_pair, rounds, options, tmp_path)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n-- options: {options}\n-- workload:\n{script(rounds)}") from exc

    prop()
