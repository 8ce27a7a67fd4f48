"""The workload generator only ever produces SQL that runs on a real publisher, leaves nothing prepared, and its
model predicts exactly which rows exist at the end (so tests built on it compare against a known truth)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from applier.testing.workloads import KEY_COLUMNS, Workload, create_schema, run_workload, workloads


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads(max_actions=40))
def test_generated_workloads_run_on_a_real_server(pair, workload: Workload):
    db = pair.publisher
    db.execute("DROP TABLE IF EXISTS wl_pk, wl_full, wl_idx")
    create_schema(db)
    run_workload(db, workload)
    assert db.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()") == 0
    for table, key in KEY_COLUMNS.items():
        got = {r[0] for r in db.query(f"SELECT {key} FROM {table}")}  # noqa: S608 - fixed names
        assert got == workload.expected_keys[table], (
            f"{table} differs from the model for:\n{workload.to_sql()}"
        )
