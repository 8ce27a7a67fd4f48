"""Decode throughput straight from a live walsender: ``python bench/decode.py --mode server``.

Starts a throwaway PostgreSQL 18 publisher (``applier.testing``), creates the slots first, inserts N rows (500,000 by
default) in one transaction, then streams that transaction through :class:`~applier.replication.ReplicationConnection`
and measures messages per second:

* ``receive``: CopyData read and the envelope decoded (what ``ReplicationConnection.read`` does on its own);
* ``receive+decode``: the same plus :class:`~applier.decoder.MessageDecoder` on every payload (what the apply loop
  pays before any apply work);
* ``decode-only``: the captured payloads decoded again from memory, to tell I/O cost from decode cost.

Each streaming pass has its own slot, created before the insert, so every pass sees the same transaction. The
server decodes the whole transaction when it reads its commit record (streaming is off), so time-to-first-message
(server-side logical decoding) and the streaming rate are reported separately.

Runs on its own too: ``python bench/decode_server.py --rows 100000``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from applier.decoder import MessageDecoder
from applier.lsn import format_lsn, parse_lsn
from applier.messages import Commit, XLogData
from applier.replication import ReplicationConnection, StreamOptions
from applier.testing import PostgresCluster, running_cluster

DEFAULT_ROWS = 500_000


@dataclass
class PassResult:
    """One streaming pass over the transaction."""

    name: str
    messages: int
    payload_bytes: int
    first_message_s: float  # START_REPLICATION to the first XLogData: the server decoding the transaction
    streaming_s: float  # first XLogData to the Commit
    total_s: float
    client_cpu_s: (
        float  # our process's CPU time over the pass: near streaming_s means we, not the server, limit
    )

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.streaming_s if self.streaming_s else float("inf")

    @property
    def msgs_per_cpu_s(self) -> float:
        """Messages per second of *our* CPU time: comparable across runs on a busy machine."""
        return self.messages / self.client_cpu_s if self.client_cpu_s else float("inf")

    @property
    def mb_per_s(self) -> float:
        return self.payload_bytes / self.streaming_s / 1e6 if self.streaming_s else float("inf")


def _stream_pass(
    cluster: PostgresCluster, slot: str, start_lsn: int, *, decode: bool, keep: list[bytes] | None = None
) -> PassResult:
    """Stream the transaction from ``slot`` until its Commit, reading (and decoding, if asked) every message."""
    decoder = MessageDecoder()
    decode_one = decoder.decode
    messages = nbytes = 0
    commit_type = ord("C")
    with ReplicationConnection().connect(cluster.dsn(), application_name=f"bench-{slot}") as rc:
        t0 = time.perf_counter()
        rc.start_replication(slot, start_lsn, StreamOptions(["bench"]))
        first = cpu0 = 0.0
        read = rc.read
        while True:
            msg = read(30.0)
            if msg is None:
                raise RuntimeError("no data from the walsender for 30 s")
            if type(msg) is not XLogData:
                continue
            if not first:
                first = time.perf_counter()
                cpu0 = time.process_time()
            payload = msg.payload
            messages += 1
            nbytes += len(payload)
            if keep is not None:
                keep.append(payload)
            if decode:
                if type(decode_one(payload)) is Commit:
                    break
            elif payload[0] == commit_type:
                break
        end = time.perf_counter()
        cpu = time.process_time() - cpu0
    return PassResult(
        name="receive+decode" if decode else "receive",
        messages=messages,
        payload_bytes=nbytes,
        first_message_s=first - t0,
        streaming_s=end - first,
        total_s=end - t0,
        client_cpu_s=cpu,
    )


def _decode_only(payloads: list[bytes]) -> PassResult:
    decoder = MessageDecoder()
    decode_one = decoder.decode
    t0, cpu0 = time.perf_counter(), time.process_time()
    for p in payloads:
        decode_one(p)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return PassResult("decode-only", len(payloads), sum(map(len, payloads)), 0.0, elapsed, elapsed, cpu)


def run_server_benchmark(rows: int = DEFAULT_ROWS, *, version: str = "18", quiet: bool = False) -> dict:
    """Run the three measurements on a fresh cluster and return them as a JSON-able dict."""

    def say(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr, flush=True)

    say(f"starting a PostgreSQL {version} publisher ...")
    with running_cluster(version, name="bench-decode") as cluster:
        cluster.execute(
            "CREATE TABLE bench (id bigint PRIMARY KEY, name text, amount numeric(12,2), created timestamptz)"
        )
        cluster.execute("CREATE PUBLICATION bench FOR TABLE bench")
        with ReplicationConnection().connect(cluster.dsn()) as rc:
            starts = {
                slot: rc.create_slot(slot).consistent_point for slot in ("bench_receive", "bench_decode")
            }
        say(f"inserting {rows:,} rows in one transaction ...")
        t0 = time.perf_counter()
        cluster.execute(
            "INSERT INTO bench SELECT g, md5(g::text), g / 100.0, now() FROM generate_series(1, %s) g",
            (rows,),
        )
        insert_s = time.perf_counter() - t0
        wal = parse_lsn(cluster.scalar("SELECT pg_current_wal_lsn()::text")) - min(starts.values())

        payloads: list[bytes] = []
        say("streaming: receive only ...")
        receive = _stream_pass(cluster, "bench_receive", starts["bench_receive"], decode=False)
        say("streaming: receive + decode ...")
        full = _stream_pass(cluster, "bench_decode", starts["bench_decode"], decode=True, keep=payloads)
        say("decoding the captured payloads from memory ...")
        offline = _decode_only(payloads)
        server_version = cluster.scalar("SHOW server_version")

    expected = rows + 3  # Begin, Relation, rows x Insert, Commit
    for result in (receive, full):
        if result.messages != expected:
            raise RuntimeError(f"{result.name}: expected {expected} messages, got {result.messages}")
    return {
        "mode": "server",
        "server_version": server_version,
        "rows": rows,
        "wal_bytes": wal,
        "wal": format_lsn(wal),
        "insert_s": round(insert_s, 3),
        "passes": [
            {
                **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(r).items()},
                "msgs_per_s": round(r.msgs_per_s),
                "msgs_per_cpu_s": round(r.msgs_per_cpu_s),
                "mb_per_s": round(r.mb_per_s, 1),
            }
            for r in (receive, full, offline)
        ],
    }


def format_report(result: dict) -> str:
    lines = [
        f"PostgreSQL {result['server_version']}: {result['rows']:,} rows in one transaction"
        f" ({result['wal_bytes'] / 1e6:.0f} MB of WAL, inserted in {result['insert_s']:.1f} s)",
        f"{'pass':<16}{'messages':>10}{'first msg s':>13}{'stream s':>10}{'our CPU s':>11}{'msgs/s':>12}"
        f"{'MB/s':>8}{'msgs/CPU-s':>12}",
    ]
    for p in result["passes"]:
        lines.append(
            f"{p['name']:<16}{p['messages']:>10,}{p['first_message_s']:>13.2f}{p['streaming_s']:>10.2f}"
            f"{p['client_cpu_s']:>11.2f}{p['msgs_per_s']:>12,}{p['mb_per_s']:>8.1f}{p['msgs_per_cpu_s']:>12,}"
        )
    return "\n".join(lines)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of server mode beyond ``--rows`` (which ``bench/decode.py`` already has)."""
    parser.add_argument(
        "--pg", default="18", help="server mode: server version (15, 16, 18) or a bindir (18)"
    )
    parser.add_argument("--json", action="store_true", help="server mode: print the result as JSON")


def main_server(args: argparse.Namespace) -> int:
    """Entry point for ``bench/decode.py --mode server``: uses ``args.rows``, ``args.pg`` and ``args.json``."""
    result = run_server_benchmark(args.rows, version=args.pg)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="rows in the one transaction (500000)")
    add_server_arguments(parser)
    return main_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
