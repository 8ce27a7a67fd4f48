"""The Spark side of the initial copy: the session and the one job that copies every partition.

The job is ``spark.range(0, n, 1, n).mapInArrow(copy)``: one Spark partition per *bin* of copy partitions, whose
task looks its descriptors up by number and copies them one after another with
:class:`tablesync.copy.PartitionCopier`. Only the DataFrame API is used, so
the same job runs on ``local[*]`` and through Spark Connect (``SPARK_REMOTE=sc://...``) on a cluster. The rows
never pass through the JVM: each Python task streams COPY bytes from the publisher straight to the target.

Executors must be able to ``import tablesync`` (and psycopg, tenacity): true locally and on a Connect server started
from this environment; on a remote cluster, install the ``applier`` package on its workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tablesync.copy import PartitionResult, refusal
from tablesync.planner import PartitionTask

log = logging.getLogger("applier.tablesync")

#: What a task returns to the driver.
RESULT_SCHEMA = (
    "task_id long, relname string, part int, rows long, bytes long, skipped boolean, seconds double,"
    " refused string"
)
#: Spark task attempts per partition in local mode (``local[N,F]``); each attempt also retries connection errors.
LOCAL_MAX_FAILURES = 4

_LOG4J2 = """\
# applier: keep Spark quiet; the copy prints its own progress.
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.spark.name = org.apache.spark
logger.spark.level = error
"""


def _machine_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 4 << 30


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process
        return True
    return True


def class_data_sharing_options() -> str:
    """JVM options for a class-data-sharing archive of Spark's classes: it halves the JVM's start-up and first job
    on a small machine (class loading and verification of ~10k classes is most of it).

    The first run asks the JVM to write the archive when it exits (``-XX:ArchiveClassesAtExit``, JDK 13+) to a
    temporary name; a later run adopts a finished one (its writer gone for a while) and maps it
    (``-XX:SharedArchiveFile``). The archive is keyed by the Java binary and pyspark's jars; a stale or damaged
    one is refused by the JVM, which then simply starts without it. ``APPLIER_SPARK_CDS=0`` turns this off.
    JVM log output (CDS warnings included) is limited to errors on stderr.
    """
    quiet = "-Xlog:disable -Xlog:all=error:stderr"
    if os.environ.get("APPLIER_SPARK_CDS", "1") == "0":
        return ""
    try:
        import pyspark

        java = shutil.which("java") or ""
        if os.environ.get("JAVA_HOME"):
            java = os.path.join(os.environ["JAVA_HOME"], "bin", "java")
        java = os.path.realpath(java)
        jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
        ident = f"{java}:{os.stat(java).st_mtime_ns}:{pyspark.__version__}:{sorted(os.listdir(jars))}"
        key = hashlib.sha1(ident.encode()).hexdigest()[:16]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "applier" / "spark-cds"
        cache.mkdir(parents=True, exist_ok=True)
        final = cache / f"{key}.jsa"
        now = time.time()
        for tmp in cache.glob(f"{key}.*.tmp"):
            pid = int(tmp.name.split(".")[1])
            age = now - tmp.stat().st_mtime
            if _pid_alive(pid) or age < 30:  # its JVM may still be writing it
                continue
            if not final.exists() and tmp.stat().st_size > 0:
                os.replace(tmp, final)
            else:
                tmp.unlink(missing_ok=True)
        if final.exists():
            return f"-XX:SharedArchiveFile={final} {quiet}"
        return f"-XX:ArchiveClassesAtExit={cache / f'{key}.{os.getpid()}.tmp'} {quiet}"
    except (OSError, ValueError):
        return ""


def default_local_conf() -> dict[str, str]:
    """Settings for ``local[*]`` on one machine.

    The driver JVM only schedules tasks and collects one small row per partition (the data goes from Python worker
    to PostgreSQL), so it needs little: an eighth of the machine, between 512 MB and 2 GB.
    """
    mem_mb = max(512, min(2048, _machine_memory_bytes() // 8 // (1 << 20)))
    log4j = os.path.join(tempfile.gettempdir(), "applier-spark-log4j2.properties")
    with contextlib.suppress(OSError):
        with open(log4j, "w") as f:
            f.write(_LOG4J2)
    return {
        "spark.app.name": "applier-tablesync",
        "spark.driver.memory": f"{mem_mb}m",
        "spark.ui.showConsoleProgress": "false",
        # The web UI (Jetty) costs about a second of start-up on a small machine, and the copy prints its own
        # progress: off unless asked for (``spark_conf={"spark.ui.enabled": "true"}``).
        "spark.ui.enabled": "false",
        # The JVM only schedules: C1-only JIT and the serial GC start it in half the time on a small machine, and
        # whole-stage codegen / adaptive execution only slow down a one-stage job over a tiny range.
        "spark.driver.extraJavaOptions": (
            f"-Dlog4j2.configurationFile=file:{log4j} -XX:TieredStopAtLevel=1 -XX:+UseSerialGC "
            + class_data_sharing_options()
        ).strip(),
        "spark.sql.codegen.wholeStage": "false",
        "spark.sql.adaptive.enabled": "false",
        "spark.python.worker.reuse": "true",
        "spark.task.maxFailures": str(LOCAL_MAX_FAILURES),
        # The copy is I/O between two servers: never let Spark speculate a second copy of a slow partition
        # (harmless thanks to the markers, but it doubles the load).
        "spark.speculation": "false",
    }


@dataclasses.dataclass
class SparkHandle:
    """A session and whether we created it (then we stop it when done; a caller's session is left running)."""

    session: Any
    created: bool
    remote: str | None
    ui_url: str | None


def runs_locally(spark_master: str | None = None) -> bool:
    """Whether the copy's Spark tasks would run on this machine (``local[...]``, the default) rather than on a
    cluster (Spark Connect, ``spark://``, ``yarn``, ...)."""
    if spark_master:
        return spark_master.startswith("local")
    return not os.environ.get("SPARK_REMOTE")


def local_parallelism(spark_master: str | None = None) -> int | None:
    """How many tasks at once a local session that the copy would create runs (``local[N]``: N, ``local[*]`` and
    the default: this process's cores), or ``None`` when the copy would not create one: a cluster or Spark Connect
    master, a master we cannot read, or a session already active in this process (whose start-up is paid)."""
    if not runs_locally(spark_master):
        return None
    context = getattr(
        sys.modules.get("pyspark.context"), "SparkContext", None
    )  # (no pyspark import for this)
    if not spark_master and context is not None and context._active_spark_context is not None:
        return None
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", spark_master or "local[*]")
    if m is None:
        return None
    if m.group(1) is None:
        return 1
    if m.group(1) == "*":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return int(m.group(1))


def spark_session(
    spark_master: str | None = None, spark_conf: Mapping[str, str] | None = None
) -> SparkHandle:
    """The session to run the copy on.

    * ``spark_master`` ``sc://host:port`` or the ``SPARK_REMOTE`` environment variable: Spark Connect.
    * otherwise an already active local session (tests share one), or a new one on ``spark_master``
      (default ``local[*,4]``: every core, four attempts per task) with :func:`default_local_conf`.
    ``spark_conf`` entries override the defaults.
    """
    with _START_LOCK:
        return _spark_session(spark_master, spark_conf)


def _spark_session(spark_master: str | None, spark_conf: Mapping[str, str] | None) -> SparkHandle:
    from pyspark.sql import SparkSession

    remote = spark_master if spark_master and spark_master.startswith("sc://") else None
    if remote is None and not spark_master:
        remote = os.environ.get("SPARK_REMOTE") or None
    if remote is not None:
        builder = SparkSession.builder.remote(remote)
        for k, v in (spark_conf or {}).items():
            builder = builder.config(k, v)
        session = builder.getOrCreate()
        return SparkHandle(session, True, remote, None)

    from pyspark import SparkContext

    if not spark_master and SparkContext._active_spark_context is not None:
        # The caller's session (a test module's, a notebook's): use it and leave it running.
        active = SparkSession.builder.getOrCreate()
        return SparkHandle(active, False, None, _ui_url(active))
    # pyspark leaves this set in the process after any Connect session, and then refuses to build a classic one.
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    # Python workers must run this interpreter (the one that has tablesync, psycopg, tenacity installed).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    conf = default_local_conf()
    conf.update(spark_conf or {})
    builder = SparkSession.builder.master(spark_master or f"local[*,{LOCAL_MAX_FAILURES}]")
    for k, v in conf.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    with contextlib.suppress(Exception):
        session.sparkContext.setLogLevel("ERROR")
    return SparkHandle(session, True, None, _ui_url(session))


def _warm_workers(batches: Iterator[Any]) -> Iterator[Any]:
    """A warm-up task: import what the copy tasks import, in a Python worker that Spark then reuses."""
    import pyarrow as pa

    import tablesync.copy  # noqa: F401 - psycopg, tenacity and the copier, loaded once per worker

    for batch in batches:
        yield pa.RecordBatch.from_pylist([{"n": len(batch)}], schema=pa.schema([("n", pa.int64())]))


#: One session start (and its stop) at a time in a process: a start abandoned by one copy (see
#: :meth:`SessionStarter.abandon`) is stopped before the next copy's session is built. Re-entrant, because
#: :func:`spark_session` takes it too: a live table sync that asks for a session while an abandoned start is still
#: running would otherwise get that session as "already active" and have it stopped under its job.
_START_LOCK = threading.RLock()


def _lower_this_thread_priority() -> None:
    """Lower the CPU priority of the calling thread, and so of the JVM it forks and the Python workers that JVM
    forks, by ``APPLIER_SPARK_NICE`` (default 10; 0 leaves it).

    Why: on one machine the JVM's start-up (class loading, JIT) wants several CPU-seconds at the very moment the
    driver's head start is copying on every core, and it slowed that copy more than it ever gave back: a local
    Spark adds no cores the head start does not already use. At a lower priority the JVM starts on what the copy
    leaves idle; on a big copy it is up soon enough and takes partitions, on a small one the copy is done first.
    Linux only, where a priority is per thread (elsewhere it would lower the whole driver); a cluster's executors
    are never affected.
    """
    try:
        nice = int(os.environ.get("APPLIER_SPARK_NICE", "10") or 0)
    except ValueError:
        nice = 10
    if nice <= 0 or sys.platform != "linux":
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def _warm_up(session: Any) -> None:
    """Spark's first job, one task per core that imports the copy's modules, paid now rather than by the copy; a
    failure here is the copy's to meet, not the start's."""
    with contextlib.suppress(Exception):
        n = default_parallelism(session)
        session.range(0, n, 1, n).mapInArrow(_warm_workers, "n long").collect()


class SessionStarter:
    """Starts the Spark session in a background thread, so the JVM's start-up overlaps the work that does not need
    it (the snapshot, planning, claims, the driver's head start); :meth:`handle` waits for it.

    For a local session created here it then runs a tiny job of one task per core that imports the copy's modules:
    Spark's first job (scheduler set-up, the Python worker daemon, a worker per core importing pyarrow and
    psycopg) is paid in the background too, and the copy's tasks reuse those workers
    (``spark.python.worker.reuse``). :meth:`release` stops a session created here, whatever happened;
    :meth:`abandon` lets the start finish and stop on its own, without waiting.
    """

    def __init__(self, spark_master: str | None = None, spark_conf: Mapping[str, str] | None = None) -> None:
        self._master = spark_master
        self._conf = dict(spark_conf or {})
        self._handle: SparkHandle | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._done = threading.Event()
        self._mu = threading.Lock()
        self.started = time.monotonic()
        self.ready_after: float | None = None  # seconds from start to a usable (and warmed) session
        self._thread = threading.Thread(target=self._start, name="tablesync-spark-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        if runs_locally(self._master):
            _lower_this_thread_priority()
        with _START_LOCK:
            try:
                self._handle = spark_session(self._master, self._conf)
                if self._handle.created and self._handle.remote is None:
                    _warm_up(self._handle.session)
                self.ready_after = time.monotonic() - self.started
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of handle()
                self._error = exc
            finally:
                with self._mu:
                    self._done.set()
                    stop_now = self._abandoned
                if stop_now and self._handle is not None:
                    release(self._handle)
                    self._handle = None

    def ready(self, timeout: float | None = None) -> bool:
        """Whether the start has ended (successfully or not), waiting up to ``timeout`` seconds."""
        return self._done.wait(timeout)

    def handle(self) -> SparkHandle:
        """The session, once started; raises what starting it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._handle is not None
        return self._handle

    def release(self) -> None:
        """Wait for the start to end, then stop the session if it was created here (see :func:`release`), in the
        background: the copy is done by then, and stopping takes about a second that nobody needs to wait for (a
        later session in this process waits for it on the start lock). Returns at once after :meth:`abandon`."""
        if self._abandoned:
            return
        self._thread.join()
        if self._handle is not None and self._handle.created:
            self._stop_in_background()

    def _stop_session(self) -> None:
        if self._handle is not None:
            release(self._handle)
            self._handle = None

    def abandon(self) -> None:
        """The session is not needed: stop it when its start ends, in the background, without waiting (stopping
        a started session takes about a second, which the copy's caller need not wait for)."""
        with self._mu:
            self._abandoned = True
            done = self._done.is_set()
        if done:
            self._stop_in_background()

    def _stop_in_background(self) -> None:
        threading.Thread(target=self._stop_locked, name="tablesync-spark-stop", daemon=True).start()

    def _stop_locked(self) -> None:
        with _START_LOCK:  # no new session may find this one still active while it stops
            self._stop_session()


def release(handle: SparkHandle) -> None:
    """Stop the session if we created it. After a Connect session, also drop the process-wide flag pyspark leaves
    behind (``SPARK_CONNECT_MODE_ENABLED``), which would otherwise turn every later classic session in this
    process into a failing Connect one."""
    if not handle.created:
        return
    with contextlib.suppress(Exception):
        handle.session.stop()
    if handle.remote is not None:
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)


def _ui_url(session: Any) -> str | None:
    try:
        return session.sparkContext.uiWebUrl
    except Exception:  # noqa: BLE001 - Connect sessions have no SparkContext
        return None


def default_parallelism(session: Any) -> int:
    """How many tasks the session runs at once, when it can tell (classic); else a guess of 4 (Connect)."""
    try:
        return max(1, int(session.sparkContext.defaultParallelism))
    except Exception:  # noqa: BLE001 - Connect sessions have no SparkContext
        return 4


def run_partition_tasks(
    session: Any,
    tasks: Sequence[PartitionTask],
    publisher_conninfo: str,
    target_conninfo: str,
    *,
    bins: Sequence[Sequence[int]] | None = None,
    tag: str | None = None,
) -> list[PartitionResult]:
    """Run the partitions as Spark tasks and return one result per partition (blocks until the job ends).

    ``bins`` groups partitions (by ``task_id``) into Spark tasks, each copying its partitions one after another
    over the same two connections (:func:`tablesync.planner.pack_tasks`); default: one partition per Spark task.
    ``tag`` labels the job so another thread can cancel it with ``session.interruptTag(tag)``.
    """
    if not tasks:
        return []
    descriptors = {t.task_id: dataclasses.asdict(t) for t in tasks}
    groups = [list(b) for b in bins] if bins is not None else [[t.task_id] for t in tasks]
    n = len(groups)

    def copy_bins(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from tablesync.copy import PartitionCopier
        from tablesync.planner import PartitionTask as Task

        schema = pa.schema(
            [
                ("task_id", pa.int64()),
                ("relname", pa.string()),
                ("part", pa.int32()),
                ("rows", pa.int64()),
                ("bytes", pa.int64()),
                ("skipped", pa.bool_()),
                ("seconds", pa.float64()),
                ("refused", pa.string()),
            ]
        )
        with PartitionCopier(publisher_conninfo, target_conninfo) as copier:
            for batch in batches:
                for bin_id in batch.column(0).to_pylist():
                    tasks = [Task(**descriptors[i]) for i in groups[bin_id]]
                    yield pa.RecordBatch.from_pylist(_copy_bin(copier, tasks), schema=schema)

    classic = _classic_context(session)
    if tag is not None:
        _tag_job(session, classic, tag)
    try:
        df = session.range(0, n, 1, n).mapInArrow(copy_bins, RESULT_SCHEMA)
        rows = df.collect()
    finally:
        if tag is not None:
            with contextlib.suppress(Exception):
                _untag_job(session, classic, tag)
    return _results(rows)


def _results(rows: list[Any]) -> list[PartitionResult]:
    """The job's rows as results; :class:`PartitionRefused` if a task met a refusal."""
    refused = next((r for r in rows if r.refused), None)
    if refused is not None:
        raise PartitionRefused(refused.refused, refused.relname)
    return [
        PartitionResult(r.task_id, r.relname, r.part, r.rows, r.bytes, r.skipped, r.seconds) for r in rows
    ]


class PartitionRefused(Exception):
    """A task met an error every attempt would meet (:func:`tablesync.copy.refusal`): the job ends with it
    after one attempt, instead of :data:`LOCAL_MAX_FAILURES`."""

    def __init__(self, message: str, relname: str) -> None:
        super().__init__(message)
        self.relname = relname


def _copy_bin(copier: Any, tasks: list[PartitionTask]) -> list[dict[str, Any]]:
    """A Spark task's rows: its partitions copied one after another, up to a refusal (a row of its own)."""
    rows: list[dict[str, Any]] = []
    for task in tasks:
        try:
            rows.append({**dataclasses.asdict(copier.copy(task)), "refused": None})
        except Exception as exc:
            refused = refusal(exc)
            if refused is None:
                raise  # Spark attempts the task again
            # every attempt would meet it: returned, not raised, so the job ends at once
            nothing = PartitionResult(task.task_id, task.relname, task.part, 0, 0, False, 0.0)
            rows.append({**dataclasses.asdict(nothing), "refused": refused})
            break
    return rows


def _tag_job(session: Any, classic: Any, tag: str) -> None:
    """Label this thread's next job with ``tag`` (a job group on classic Spark, a tag on Spark Connect), for
    :func:`cancel_job`."""
    if classic is not None:
        # interruptOnCancel: cancelling interrupts the task threads, and Spark then kills the Python workers
        # (after spark.python.task.killTimeout), closing their connections: the partitions roll back.
        classic.setJobGroup(tag, "applier initial copy", interruptOnCancel=True)
    else:
        session.addTag(tag)


def _untag_job(session: Any, classic: Any, tag: str) -> None:
    if classic is not None:
        classic.setLocalProperty("spark.jobGroup.id", None)
    else:
        session.removeTag(tag)


def _classic_context(session: Any) -> Any:
    """The SparkContext of a classic session; None for Spark Connect."""
    try:
        return session.sparkContext
    except Exception:  # noqa: BLE001 - Connect sessions raise on sparkContext
        return None


def cancel_job(session: Any, tag: str) -> None:
    """Cancel the job :func:`run_partition_tasks` runs with ``tag`` (from another thread)."""
    classic = _classic_context(session)
    if classic is not None:
        classic.cancelJobGroup(tag)
    else:
        session.interruptTag(tag)
