"""The catalog on a real target: creation, versioning, cluster-wide subids, table states, prepared records."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from applier.catalog.store import CATALOG_VERSION, Catalog, CatalogError, PreparedRecord
from state.twophase import gid_for

pytestmark = pytest.mark.core


def _create(cat: Catalog, name: str):
    return cat.create_subscription(
        subname=name, conninfo="host=x dbname=y", publications=["pub"], two_phase_state="p", streaming="on",
        binary=False, disable_on_error=False, origin="any", slot_name=name, enabled=True, copy_data=True,
    )  # fmt: skip


@pytest.mark.anyversion  # our catalog's versioning
def test_catalog_is_created_once_and_versioned(pair):
    cat = Catalog.connect(pair.target.dsn)
    assert not cat.exists()
    assert cat.ensure() == CATALOG_VERSION
    assert cat.ensure() == CATALOG_VERSION
    assert pair.target.scalar("SELECT count(*) FROM applier.catalog_version") == 1
    pair.target.execute("INSERT INTO applier.catalog_version (version) VALUES (%s)", (CATALOG_VERSION + 1,))
    with pytest.raises(CatalogError, match="newer than this release"):
        cat.ensure()


@pytest.mark.anyversion  # our catalog's ids
def test_subids_are_unique_across_the_cluster(pair, target_cluster):
    other = target_cluster.create_database(pair.name + "_b")
    try:
        a, b = Catalog.connect(pair.target.dsn), Catalog.connect(other.dsn)
        a.ensure()
        b.ensure()
        s1 = _create(a, "s1")
        s2 = _create(b, "s2")  # its own catalog is empty, but subid 1's origin exists in the cluster
        assert s1.subid != s2.subid
        origins = {r[0] for r in pair.target.query("SELECT roname FROM pg_replication_origin")}
        assert {s1.origin_name, s2.origin_name} <= origins
        with pytest.raises(CatalogError, match="already exists"):
            _create(a, "s1")
        b.delete_subscription(s2.subid)
        assert s2.origin_name not in {
            r[0] for r in pair.target.query("SELECT roname FROM pg_replication_origin")
        }
    finally:
        target_cluster.drop_database(other.name)


def test_columns_have_the_pg_subscription_types(pair):
    cat = Catalog.connect(pair.target.dsn)
    cat.ensure()
    sub = _create(cat, "typed")
    types = dict(
        pair.target.query(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = 'applier.subscription'::regclass AND attnum > 0"
        )
    )
    assert types["subtwophasestate"] == '"char"' and types["subskiplsn"] == "pg_lsn"
    assert types["subpublications"] == "text[]" and types["subid"] == "bigint"
    cat.update_subscription(sub.subid, subskiplsn=0x1_0000_0010)
    assert pair.target.scalar("SELECT subskiplsn::text FROM applier.subscription") == "1/10"
    assert not cat.clear_skip_lsn(sub.subid, expected=0x99)
    assert cat.clear_skip_lsn(sub.subid, expected=0x1_0000_0010)
    assert cat.require("typed").subskiplsn is None


def test_table_states_and_prepared_records(pair):
    pair.target.execute('CREATE TABLE "Odd Name" (id int)')
    cat = Catalog.connect(pair.target.dsn)
    cat.ensure()
    sub = _create(cat, "tables")
    relid = pair.target.scalar("""SELECT '"Odd Name"'::regclass::oid""")
    cat.add_table(sub.subid, relid, 'public."Odd Name"', "i")
    cat.set_table_state(sub.subid, relid, "s", 0x2_0000_0000)
    [rel] = cat.table_states(sub.subid)
    assert (rel.name, rel.state, rel.lsn) == ('public."Odd Name"', "s", 0x2_0000_0000)
    with cat.engine.connect() as c:
        assert c.execute(sa.text("SELECT srsubstate FROM applier.subscription_rel")).scalar() == "s"

    gid = gid_for(sub.subid, 1234)
    rec = PreparedRecord(gid, sub.subid, 1234, 10, 20, 123456789)
    cat.record_prepared(rec)
    cat.record_prepared(rec)  # idempotent: a replayed prepare after a crash
    assert cat.prepared_record(gid) == rec
    assert cat.reconcile_prepared(sub.subid) == 1  # no such prepared xact on the server
    assert cat.prepared_record(gid) is None
