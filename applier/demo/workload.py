"""The demo's live workload on the publisher: ordinary transactions mixed with prepared transactions that are
committed or rolled back a little later (after other transactions have committed in between), so the target shows
prepared transactions pending side by side with the publisher's."""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import psycopg

from applier.testing import Database


@dataclass
class WorkloadStats:
    committed: int = 0
    prepared: int = 0
    commit_prepared: int = 0
    rollback_prepared: int = 0


class LiveWorkload(threading.Thread):
    """Runs until ``stop`` is set, at about ``rate`` transactions a second; then resolves what it prepared."""

    def __init__(
        self,
        db: Database,
        *,
        first_order_id: int,
        max_order_id: int,
        rate: float = 40.0,
        prepared_share: float = 0.25,
        rollback_share: float = 0.2,
        seed: int = 7,
    ) -> None:
        super().__init__(name="demo-workload", daemon=True)
        self.db, self.rate = db, rate
        self.next_order = first_order_id
        self.max_order_id = max_order_id
        self.prepared_share, self.rollback_share = prepared_share, rollback_share
        self.rng = random.Random(seed)
        self.stats = WorkloadStats()
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.pending: deque[str] = deque()

    def run(self) -> None:
        try:
            with self.db.connect() as conn:
                n = 0
                while not self.stop_event.is_set():
                    started = time.monotonic()
                    n += 1
                    self._step(conn, n)
                    pause = 1.0 / self.rate - (time.monotonic() - started)
                    self.stop_event.wait(max(pause, 0.0))
                while self.pending:
                    self._resolve(conn)
        except BaseException as exc:  # noqa: BLE001 - reported by the demo
            self.error = exc

    def _step(self, conn: psycopg.Connection, n: int) -> None:
        """One transaction, prepared or ordinary, and sometimes the decision of earlier prepared ones."""
        if self.rng.random() < self.prepared_share:
            self._prepared(conn, n)
        else:
            self._ordinary(conn)
        if self.pending and (len(self.pending) > 3 or self.rng.random() < 0.3):
            self._resolve(conn)

    def _new_order(self, conn: psycopg.Connection) -> None:
        oid = self.next_order
        self.next_order += 1
        conn.execute(
            "INSERT INTO orders VALUES (%s, %s, now(), 'new', %s, NULL)",
            (oid, 1 + oid % 100, round(self.rng.uniform(1, 500), 2)),
        )
        conn.execute(
            "INSERT INTO order_lines SELECT %s, l, 1 + l * 7, l, 9.99 FROM generate_series(1, %s) l",
            (oid, self.rng.randint(1, 4)),
        )

    def _ordinary(self, conn: psycopg.Connection) -> None:
        with conn.transaction():
            self._new_order(conn)
            conn.execute(
                "UPDATE orders SET status = 'paid', total = total + 0.01 WHERE id = %s",
                (self.rng.randint(1, self.max_order_id),),
            )
            conn.execute(
                "INSERT INTO events (kind, payload) VALUES ('order', jsonb_build_object('at', now()))"
            )
            if self.rng.random() < 0.2:
                conn.execute("DELETE FROM events WHERE id = (SELECT min(id) FROM events)")
        self.stats.committed += 1

    def _prepared(self, conn: psycopg.Connection, n: int) -> None:
        gid = f"demo_{n}"
        conn.execute("BEGIN")
        self._new_order(conn)
        conn.execute(
            "INSERT INTO events (kind, payload) VALUES ('prepared', jsonb_build_object('gid', %s::text))",
            (gid,),
        )
        conn.execute(f"PREPARE TRANSACTION '{gid}'")  # noqa: S608 - gid is ours
        self.pending.append(gid)
        self.stats.prepared += 1

    def _resolve(self, conn: psycopg.Connection) -> None:
        gid = self.pending.popleft()
        if self.rng.random() < self.rollback_share:
            conn.execute(f"ROLLBACK PREPARED '{gid}'")  # noqa: S608
            self.stats.rollback_prepared += 1
        else:
            conn.execute(f"COMMIT PREPARED '{gid}'")  # noqa: S608
            self.stats.commit_prepared += 1
