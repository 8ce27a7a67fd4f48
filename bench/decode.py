"""Decoder throughput: how many pgoutput messages a second the codec turns into message objects.

Builds, with the encoder, one large transaction the way a bulk ``INSERT`` reaches a subscriber — Begin, Relation,
N Inserts of a realistic 5-column row (int, text with some NULLs, timestamptz, numeric, bool, all in text format as
pgoutput sends them without ``binary``), Commit — and times:

* ``message``: ``decode_message`` on each payload (the codec alone);
* ``envelope``: ``decode_envelope`` + ``decode_message`` on XLogData-wrapped payloads (what the apply loop does
  with every CopyData from the walsender).

Run: ``.venv/bin/python bench/decode.py [--mode message|envelope|all] [--rows N] [--repeat R]``. Each mode prints
one line with the best of ``--repeat`` runs, as messages/s of wall-clock and of CPU time (on a shared machine the
wall clock mostly measures the neighbours). Other modes plug in as further ``--mode`` choices.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from applier.decoder import decode_envelope, decode_message
from applier.encoder import encode_envelope, encode_message
from applier.messages import Begin, Commit, Insert, Relation, RelationColumn, TupleData, XLogData

RELID = 16384
FIRST_LSN = 0x1_6B37_4800
COMMIT_TIME = 800_000_000_000_000  # 2025-05-07, µs since 2000-01-01


def build_insert_stream(rows: int) -> list[bytes]:
    """The encoded payloads of one transaction inserting ``rows`` rows: Begin, Relation, Inserts, Commit."""
    commit_lsn = FIRST_LSN + 100 * (rows + 2)
    relation = Relation(
        xid=None,
        relid=RELID,
        namespace="public",
        relname="orders",
        replident="d",
        columns=(
            RelationColumn(1, "id", 20, -1),  # bigint, replica identity
            RelationColumn(0, "customer", 25, -1),  # text
            RelationColumn(0, "created_at", 1184, -1),  # timestamptz
            RelationColumn(0, "amount", 1700, 655366),  # numeric(10,2)
            RelationColumn(0, "paid", 16, -1),  # boolean
        ),
    )
    payloads = [encode_message(Begin(commit_lsn, COMMIT_TIME, 7_654_321)), encode_message(relation)]
    for i in range(rows):
        customer = None if i % 17 == 0 else f"customer {i % 9973:04d} Ünïcode".encode()
        kinds = b"t" + (b"n" if customer is None else b"t") + b"ttt"
        created = f"2025-05-07 {i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}.{i % 1_000_000:06d}+00"
        values = (
            str(1_000_000 + i).encode(),
            customer,
            created.encode(),
            f"{i % 100_000}.{i % 100:02d}".encode(),
            b"t" if i % 3 else b"f",
        )
        payloads.append(encode_message(Insert(None, RELID, TupleData(kinds, values))))
    payloads.append(encode_message(Commit(0, commit_lsn, commit_lsn + 40, COMMIT_TIME)))
    return payloads


def wrap_in_xlogdata(payloads: Sequence[bytes]) -> list[bytes]:
    """Each payload as the CopyData the walsender would send: an XLogData at increasing WAL positions."""
    out = []
    lsn = FIRST_LSN
    for p in payloads:
        out.append(encode_envelope(XLogData(lsn, lsn + 100, COMMIT_TIME, p)))
        lsn += 100
    return out


def run_message(payloads: Sequence[bytes], _envelopes: Sequence[bytes]) -> int:
    decode = decode_message
    for p in payloads:
        decode(p)
    return len(payloads)


def run_envelope(_payloads: Sequence[bytes], envelopes: Sequence[bytes]) -> int:
    decode_env = decode_envelope
    decode = decode_message
    for e in envelopes:
        env = decode_env(e)
        if type(env) is XLogData:
            decode(env.payload)
    return len(envelopes)


#: mode name -> (description, runner). A runner decodes everything once and returns the number of messages.
MODES: dict[str, tuple[str, Callable[[Sequence[bytes], Sequence[bytes]], int]]] = {
    "message": ("decode_message", run_message),
    "envelope": ("decode_envelope + decode_message", run_envelope),
}


def best_times(
    runner: Callable[[Sequence[bytes], Sequence[bytes]], int],
    payloads: list[bytes],
    envelopes: list[bytes],
    repeat: int,
) -> tuple[int, float, float]:
    """Message count and the best wall-clock and best CPU seconds over ``repeat`` runs.

    Best, not mean: we measure the code, not the machine's neighbours. CPU time is reported too because on a
    shared machine the wall clock mostly measures the other tenants.
    """
    best_wall = best_cpu = float("inf")
    count = 0
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        count = runner(payloads, envelopes)
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    return count, best_wall, best_cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode",
        choices=[*MODES, "all", "server"],
        default="all",
        help="what to time (default: all); 'server' streams from a live PostgreSQL 18 (bench/decode_server.py)",
    )
    parser.add_argument("--rows", type=int, default=500_000, help="rows in the insert transaction (500000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode; the best is reported (3)")
    from decode_server import add_server_arguments, main_server  # bench/ is sys.path[0] when run as a script

    add_server_arguments(parser)
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeat < 1:
        parser.error("--rows and --repeat must be positive")
    if args.mode == "server":  # not part of "all": it starts a server and takes half a minute
        return main_server(args)

    t0 = time.perf_counter()
    payloads = build_insert_stream(args.rows)
    envelopes = wrap_in_xlogdata(payloads)
    size = sum(map(len, payloads))
    print(
        f"built {len(payloads):,} messages ({size / 1e6:.1f} MB of pgoutput) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )

    for mode in MODES if args.mode == "all" else (args.mode,):
        label, runner = MODES[mode]
        count, wall, cpu = best_times(runner, payloads, envelopes, args.repeat)
        print(
            f"{mode:<9} {label:<34} {count / wall:>10,.0f} msgs/s wall, {count / cpu:>10,.0f} msgs/s CPU"
            f"  ({count:,} messages, best of {args.repeat}: {wall:.2f} s wall, {cpu:.2f} s CPU)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
