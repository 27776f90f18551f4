"""The servers the chaos battery and the tests use: PRIVATE PostgreSQL, PgBouncer, redis-server
and beanstalkd processes on free loopback ports with their data in a temp dir.

Private servers are started in their own session and killed by pid / process group (only what
this process started): restarting or killing one never touches the shared servers. ``Postgres``
(a database on an existing server, created fresh and dropped at the end) is kept for running the
battery against a server given on the command line; it never restarts that server.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def accepts(address: tuple[str, int]) -> bool:
    """Does anything accept connections at ``address``?"""
    try:
        socket.create_connection(address, timeout=1).close()
    except OSError:
        return False
    return True


def sigkill(popen: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL the process ``popen`` started, if it still runs, and reap it."""
    if popen is not None and popen.poll() is None:
        os.kill(popen.pid, signal.SIGKILL)
        popen.wait(10)


def free_cluster_port() -> int:
    """A free port for a Redis Cluster node: at most 55535, and its bus port (10000 higher)
    free too."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for candidate in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _at_exit(callback: Any) -> None:
    """Run ``callback`` when THIS process exits (not in a forked child that exits normally)."""
    owner = os.getpid()

    def run() -> None:
        if os.getpid() == owner:
            callback()

    atexit.register(run)


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# -- PostgreSQL ---------------------------------------------------------------------------------


class Postgres:
    """A dedicated database on a server: created fresh, dropped at the end. It never restarts
    the server (with ``--pg-external`` that is a shared one)."""

    def __init__(self, name: str, host: str, port: str, user: str, password: str = "") -> None:
        self.name, self.host, self.port, self.user, self.password = name, host, port, user, password

    def _admin(self) -> Any:
        import psycopg

        return psycopg.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password or None,
            dbname="postgres",
            autocommit=True,
            connect_timeout=5,
        )

    def create(self) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.name}"')

    def drop(self) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def ready(self) -> bool:
        return subprocess.run(["pg_isready", "-q", "-h", self.host, "-p", str(self.port)], check=False).returncode == 0


class PrivatePostgres:
    """A PostgreSQL server of its own: ``initdb`` into a fresh temp dir, then ``postgres`` on a free
    loopback port (and a Unix socket in the same temp dir), in its own session.

    Run as root, the server runs as the ``postgres`` OS user (PostgreSQL refuses root); the temp
    dir is chowned to it. Durability settings are PostgreSQL's defaults (fsync on), so
    ``restart`` (a crash: SIGKILL of the postmaster and every backend, then a start that replays
    the WAL) loses nothing a client saw committed.

    ``kill``/``restart``/``stop`` signal only the processes this object started: the postmaster
    it spawned and that postmaster's process group. The shared server is never touched.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        port: int | None = None,
        os_user: str = "postgres",
        options: dict[str, str] | None = None,
    ) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL's initdb/postgres binaries were not found (set PG_BINDIR)")
        self.bindir: Path = bindir
        base = Path(tempfile.mkdtemp(prefix="pgprivate-", dir=directory))
        self.directory = base
        self.data = base / "data"
        self.sockets = base / "sock"
        self.sockets.mkdir()
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.user = "postgres"
        self.url = f"postgresql://{self.user}@{self.host}:{self.port}/postgres"
        self.options = {"max_connections": "200", **(options or {})}
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._run_as: dict[str, Any] = {}
        if os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam(os_user)
            self._run_as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            for path in (base, self.sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._initdb()
        _at_exit(self.cleanup)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"

    def _initdb(self) -> None:
        proc = subprocess.run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                self.user,
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",  # only initdb's final fsync of the fresh files; the server fsyncs
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            **self._run_as,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"initdb failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    @property
    def log_path(self) -> Path:
        return self.directory / f"postgres-{self.starts}.log"

    def start(self, timeout: float = 60) -> None:
        if self.popen is not None and self.popen.poll() is None:
            return
        self.starts += 1
        args = [
            str(self.bindir / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-k",
            str(self.sockets),
            "-c",
            f"listen_addresses={self.host}",
        ]
        for key, value in self.options.items():
            args += ["-c", f"{key}={value}"]
        log = open(self.log_path, "wb")  # noqa: SIM115 (the child keeps it)
        self.popen = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill() signals exactly that group
            **self._run_as,
        )
        log.close()
        wait_for(self._serving, timeout, f"the private PostgreSQL on port {self.port}", interval=0.1)

    def _connect(self, dbname: str = "postgres", timeout: int = 2) -> Any:
        import psycopg

        return psycopg.connect(
            host=self.host, port=self.port, user=self.user, dbname=dbname, autocommit=True, connect_timeout=timeout
        )

    def connect(self, dbname: str = "postgres") -> Any:
        """A psycopg connection (autocommit) to ``dbname`` on this server."""
        return self._connect(dbname, timeout=5)

    def _serving(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            raise RuntimeError(f"postgres exited ({self.popen.returncode}):\n{tail}")
        return self.ready()

    def ready(self) -> bool:
        """True when the server accepts a connection and answers a query (recovery finished)."""
        try:
            with self._connect() as conn:
                conn.execute("SELECT 1")
            return True
        except Exception:  # noqa: BLE001 - any failure means "not ready yet"
            return False

    def _children(self) -> list[int]:
        """The postmaster's child processes now (backends, checkpointer, walwriter, ...). Each
        child is its own process group leader (PostgreSQL calls setsid() in every child), so
        they are found by parent pid, not by group."""
        if self.popen is None:
            return []
        parent = self.popen.pid
        children: list[int] = []
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            return []
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children += [int(pid) for pid in f.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
        return children

    def kill(self) -> None:
        """A crash: the postmaster and every child it has (backends and auxiliary processes)
        are SIGKILLed at once (the postmaster is SIGSTOPped first so it forks no new child while
        they are listed). Returns once they are all gone, so a start can reuse the data dir at
        once (PostgreSQL refuses to while an old process still holds the shared memory)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        pid = self.popen.pid
        os.kill(pid, signal.SIGSTOP)
        children = self._children()
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(pid, signal.SIGKILL)
        self.popen.wait(10)
        # Reparented to init now; a zombie counts as gone (it no longer holds the shared memory).
        wait_for(lambda: not any(_alive(c) for c in children), 30, "the private PostgreSQL's processes to exit")

    def stop(self, timeout: float = 30) -> None:
        """A clean (fast) shutdown: SIGINT, which disconnects clients and checkpoints; SIGKILL if
        it takes longer than ``timeout``."""
        if self.popen is None or self.popen.poll() is not None:
            return
        os.kill(self.popen.pid, signal.SIGINT)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, outage: float = 1.0) -> tuple[float, float]:
        """Crash (``kill``), stay down ``outage`` seconds, start (crash recovery replays the WAL)
        and wait until it answers. Returns (down, up) as time.time() values."""
        down = time.time()
        self.kill()
        time.sleep(outage)
        self.start()
        return down, time.time()

    def terminate_backends(self, dbname: str | None = None) -> int:
        """``pg_terminate_backend`` of every other client backend (of ``dbname`` if given): the
        clients see their connection drop while the server stays up. Returns how many."""
        return self._count_clients("count(*) FILTER (WHERE pg_terminate_backend(pid))", dbname)

    def create_database(self, name: str) -> None:
        with self._connect(timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')

    def drop_database(self, name: str) -> None:
        with self._connect(timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def connections(self, dbname: str | None = None) -> int:
        """Client backends connected now (to ``dbname`` if given), this query's own excluded."""
        return self._count_clients("count(*)", dbname)

    def _count_clients(self, aggregate: str, dbname: str | None) -> int:
        """``aggregate`` over the other client backends (of ``dbname`` if given)."""
        query = (
            f"SELECT {aggregate} FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        params: tuple[str, ...] = ()
        if dbname is not None:
            query += " AND datname = %s"
            params = (dbname,)
        with self._connect() as conn:
            row = conn.execute(query, params).fetchone()
        return int(row[0]) if row else 0

    def cleanup(self) -> None:
        """Kill this server (only its own processes) and remove its temp dir. Idempotent."""
        try:
            self.kill()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class PrivatePgBouncer:
    """PgBouncer in transaction pooling mode on a free loopback port, in front of the PostgreSQL
    server at ``server_port`` on 127.0.0.1 (every database name maps to the same name there;
    trust, user ``postgres``), its config and log in a temp dir, in its own session.

    Run as root, it runs as the ``postgres`` OS user (PgBouncer refuses root). A restart of the
    server behind it is the server's own: the pooler keeps its clients' connections, and those
    in a transaction when the server went see it fail. It tries a failed server login again
    after 1 s (``server_login_retry``), so its clients are kept out about as long as the
    server is down."""

    def __init__(self, server_port: int | str, *, os_user: str = "postgres") -> None:
        binary = shutil.which("pgbouncer")
        if binary is None:
            raise RuntimeError("pgbouncer is not on PATH (apt-get install pgbouncer)")
        self.binary = binary
        self.host = "127.0.0.1"
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="pgbouncerprivate-"))
        config = self.directory / "pgbouncer.ini"
        config.write_text(
            f"[databases]\n* = host=127.0.0.1 port={server_port}\n\n[pgbouncer]\n"
            f"listen_addr = {self.host}\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.directory / 'userlist.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 20\nmax_client_conn = 500\n"
            # After a failed server login PgBouncer refuses new ones for this long (default 15 s):
            # a 1 s restart of the server would keep the workers out for 15, past their leases.
            "server_login_retry = 1\n"
            f"logfile = {self.directory / 'pgbouncer.log'}\n"
        )
        (self.directory / "userlist.txt").write_text('"postgres" ""\n')
        self.config = config
        self._run_as: dict[str, Any] = {}
        if os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam(os_user)
            self._run_as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            for path in (self.directory, *self.directory.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.popen: subprocess.Popen[bytes] | None = None
        _at_exit(self.cleanup)

    def start(self) -> None:
        self.popen = subprocess.Popen(
            [self.binary, str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            **self._run_as,
        )
        wait_for(self._serving, 30, f"the private PgBouncer on port {self.port}")

    def _serving(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"pgbouncer exited ({self.popen.returncode}): see {self.directory}/pgbouncer.log")
        return accepts((self.host, self.port))

    def cleanup(self) -> None:
        """Kill it (only the process this object started) and remove its temp dir. Idempotent."""
        sigkill(self.popen)
        shutil.rmtree(self.directory, ignore_errors=True)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def postgres_bindir() -> Path | None:
    """Where initdb and postgres are: $PG_BINDIR, the newest /usr/lib/postgresql/<v>/bin, or PATH."""
    candidates = []
    if os.environ.get("PG_BINDIR"):
        candidates.append(Path(os.environ["PG_BINDIR"]))
    root = Path("/usr/lib/postgresql")
    if root.is_dir():
        versions = sorted((d for d in root.iterdir() if d.name.isdigit()), key=lambda d: int(d.name), reverse=True)
        candidates += [d / "bin" for d in versions]
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    for candidate in candidates:
        if (candidate / "initdb").exists() and (candidate / "postgres").exists():
            return candidate
    return None


# -- Redis --------------------------------------------------------------------------------------


class PrivateRedis:
    """redis-server with an AOF fsynced every second (``--appendonly yes --appendfsync everysec``)
    and no RDB snapshots, in ``directory``. ``restart`` is a crash: SIGKILL, then a start that
    replays the AOF (the kernel keeps what Redis wrote, so only a host crash could lose the
    last second)."""

    def __init__(self, directory: Path | None = None, args: Sequence[str] = ()) -> None:
        """``args``: more redis-server options (``--replicaof host port``, a cluster node's)."""
        self.port = free_cluster_port() if "--cluster-enabled" in args else free_port()
        self.host = "127.0.0.1"
        self.args = list(args)
        self._own_directory = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="redisprivate-")) if directory is None else directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        _at_exit(self.kill)  # never outlive this process, even without a cleanup()

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError("redis-server is not on PATH")
        self.starts += 1
        log = open(self.directory / f"redis-{self.starts}.log", "wb")  # noqa: SIM115 (the child keeps it)
        self.popen = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(self.directory),
                "--daemonize",
                "no",
                *self.args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._serving, 60, f"the private redis-server on port {self.port}")

    def _serving(self) -> bool:
        import redis

        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"redis-server exited ({self.popen.returncode}): see {self.directory}")
        try:
            with redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1) as client:
                return bool(client.ping()) and client.info("persistence").get("loading") == 0
        except redis.exceptions.RedisError:
            return False

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def restart(self, outage: float = 1.0) -> tuple[float, float]:
        """SIGKILL, ``outage`` seconds down (an outage, not just a reconnect), a start that
        replays the AOF. Returns (down, up) as time.time() values."""
        down = time.time()
        self.kill()
        time.sleep(outage)
        self.start()
        return down, time.time()

    def cleanup(self) -> None:
        """Kill this server (only the process this object started); remove the temp dir if
        this object created it. Idempotent."""
        self.kill()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


# A cluster node: it gives up on a silent peer after 1 s, and a replica takes over whatever its
# link's age (a primary killed a moment after the last write still fails over).
CLUSTER_NODE = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0")


class PrivateRedisCluster:
    """A Redis Cluster of three primaries with a replica each: six :class:`PrivateRedis` nodes
    (AOF fsynced every second) created with ``redis-cli --cluster create``. ``restart`` is a
    primary's crash: the primary serving the ``default`` queue is SIGKILLed, its replica takes
    over (the cluster serves every slot again), then the killed node starts again and rejoins
    as the new primary's replica. Writes the old primary acknowledged but had not replicated yet
    are lost (asynchronous replication)."""

    SLOT_KEY = "{default}"

    def __init__(self, directory: Path | None = None) -> None:
        self._own_directory = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="redisclusterprivate-")) if directory is None else directory
        self.nodes = [PrivateRedis(self.directory / f"node{i}", CLUSTER_NODE) for i in range(6)]
        self.host = "127.0.0.1"
        self.startup_nodes = [(node.host, node.port) for node in self.nodes]
        self.url = self.nodes[0].url
        self.failovers = 0

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"{host}:{port}" for host, port in self.startup_nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(self.healthy, 60, "the private Redis Cluster to serve every slot, each primary with its replica")

    def client(self) -> Any:
        import redis

        nodes = [redis.cluster.ClusterNode(host, port) for host, port in self.startup_nodes]
        return redis.RedisCluster(startup_nodes=nodes, socket_connect_timeout=2)

    def _info(self, node: PrivateRedis, section: str) -> dict[str, Any]:
        """``CLUSTER INFO`` (``section`` "cluster") or an ``INFO`` section of one node."""
        import redis

        with redis.Redis(host=node.host, port=node.port, socket_connect_timeout=1, socket_timeout=2) as client:
            reply = client.execute_command("CLUSTER INFO") if section == "cluster" else client.info(section)
        return {str(k): str(v.decode() if isinstance(v, bytes) else v) for k, v in dict(reply).items()}

    def healthy(self) -> bool:
        """Every node up and agreeing that every slot is served; three replicas in sync."""
        import redis

        try:
            if any(self._info(node, "cluster").get("cluster_state") != "ok" for node in self.nodes):
                return False
            roles = [self._info(node, "replication") for node in self.nodes]
        except redis.exceptions.RedisError:
            return False
        synced = [r for r in roles if r.get("role") == "slave" and r.get("master_link_status") == "up"]
        return len(synced) == 3

    def primary_of(self, key: str) -> PrivateRedis:
        """The node serving ``key``'s slot now (asked of the cluster)."""
        client = self.client()
        try:
            port = client.get_node_from_key(key).port
        finally:
            client.close()
        return next(node for node in self.nodes if node.port == port)

    def restart(self, outage: float = 1.0) -> tuple[float, float]:
        """Once the cluster is whole (an earlier victim rejoined and synced), SIGKILL the primary
        of the ``default`` queue's slot; ``up`` is when another node serves that slot (its
        replica, promoted), at least ``outage`` seconds later. The killed node is started again
        and rejoins as a replica meanwhile. Returns (down, up)."""
        wait_for(self.healthy, 60, "every primary to have a replica in sync")
        victim = self.primary_of(self.SLOT_KEY)
        down = time.time()
        victim.kill()
        time.sleep(outage)
        wait_for(lambda: self._served_by_another(victim), 60, "a replica to take over the killed primary's slots")
        up = time.time()
        self.failovers += 1
        victim.start()
        return down, up

    def _served_by_another(self, victim: PrivateRedis) -> bool:
        import redis

        try:
            return self.primary_of(self.SLOT_KEY) is not victim
        except (redis.exceptions.RedisError, StopIteration):
            return False

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def cleanup(self) -> None:
        """Kill its nodes (only the processes this object started); remove the temp dir if this
        object created it. Idempotent."""
        self.kill()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


# A replica's full sync starts at once (Redis waits 5 s for more replicas to share it by default).
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]


class PrivateSentinelGroup:
    """A Redis Sentinel group of its own: a primary and a replica (``PrivateRedis``, AOF on) and
    three sentinels (quorum 2) monitoring them as :attr:`SERVICE`, on free loopback ports, in a
    temp dir. ``failover`` is ``SENTINEL FAILOVER``; ``kill_primary`` a SIGKILL of the primary,
    the sentinels' promotion of the replica, and a start of the killed server, which they turn
    into the new primary's replica. Either waits until every sentinel names the new primary."""

    SERVICE = "mymaster"

    def __init__(self, directory: Path | None = None, min_replicas: int = 0) -> None:
        """``min_replicas``: the servers' ``min-replicas-to-write`` (a primary refuses writes
        while fewer replicas are in sync with it, lagging at most 10 s)."""
        self._own_directory = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="sentinelprivate-")) if directory is None else directory
        args = [*FAST_SYNC, "--min-replicas-to-write", str(min_replicas), "--min-replicas-max-lag", "10"]
        first = PrivateRedis(self._subdirectory("a"), args)
        second = PrivateRedis(self._subdirectory("b"), [*args, "--replicaof", "127.0.0.1", str(first.port)])
        self.servers = {first.port: first, second.port: second}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{self.SERVICE}/0"
        self.failovers = 0
        _at_exit(self.kill)

    def _subdirectory(self, name: str) -> Path:
        path = self.directory / f"sentinel-group-{name}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self) -> None:
        for server in self.servers.values():
            server.start()
        primary = next(iter(self.servers))
        for port in self.sentinel_ports:
            (self.directory / f"sentinel-{port}.conf").write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
                f"sentinel failover-timeout {self.SERVICE} 3000\n"
            )
        self.start_sentinels()
        wait_for(lambda: self._settled(primary), 60, "the private sentinels to see each other and the replica")

    def start_sentinels(self) -> None:
        """Start the sentinels from their config files (which they rewrite with what they know)."""
        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError("redis-server is not on PATH")
        for port in self.sentinel_ports:
            log = open(self.directory / f"sentinel-{port}.log", "ab")  # noqa: SIM115 (the child keeps it)
            self.sentinels.append(
                subprocess.Popen(
                    [binary, str(self.directory / f"sentinel-{port}.conf"), "--sentinel"],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
        wait_for(lambda: self._named(self.primary()), 60, "the private sentinels to name the primary")

    def stop_sentinels(self) -> None:
        """SIGKILL every sentinel (the servers go on)."""
        for sentinel in self.sentinels:
            if sentinel.poll() is None:
                os.kill(sentinel.pid, signal.SIGKILL)
                sentinel.wait(10)
        self.sentinels = []

    def settle(self, timeout: float = 60) -> None:
        """Wait until the group could fail over again (the demoted primary is a synced replica)."""
        primary = self.primary()
        wait_for(lambda: self._settled(primary), timeout, f"the group around port {primary} to settle")

    def _ask(self, port: int, *command: Any) -> Any:
        import redis

        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True) as client:
            return client.execute_command(*command)

    def primary(self) -> int:
        """The port of the primary the first sentinel names."""
        return int(self._ask(self.sentinel_ports[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)[1])

    def _named(self, primary: int) -> bool:
        """Every sentinel names ``primary``, up, as the service's primary."""
        import redis

        try:
            for port in self.sentinel_ports:
                fields = self._ask(port, "SENTINEL", "MASTER", self.SERVICE)  # a dict of strings
                if int(fields["port"]) != primary or fields["flags"] != "master":
                    return False
        except (redis.exceptions.RedisError, OSError, KeyError, ValueError):
            return False
        return True

    def _settled(self, primary: int) -> bool:
        """``primary`` is named, serves with its replica in sync, and every sentinel knows the
        two others and the replica: a failover has its quorum and a replica to promote."""
        import redis

        if not self._named(primary):
            return False
        try:
            for port in self.sentinel_ports:
                fields = self._ask(port, "SENTINEL", "MASTER", self.SERVICE)
                if int(fields["num-other-sentinels"]) != 2 or int(fields["num-slaves"]) < 1:
                    return False
                replicas = self._ask(port, "SENTINEL", "REPLICAS", self.SERVICE)  # the sentinel's view
                if not any(r["flags"] == "slave" and r.get("master-link-status") == "ok" for r in replicas):
                    return False
            info = self._ask(primary, "INFO", "replication")  # a dict
            return bool(info["role"] == "master" and info.get("slave0", {}).get("state") == "online")
        except (redis.exceptions.RedisError, OSError, KeyError, ValueError):
            return False

    def _switch(self, act: Any, timeout: float) -> tuple[int, float, float]:
        """Wait for a settled group (a demoted primary takes up to 10 s to rejoin as a replica:
        the sentinels' INFO period), ``act(old port)``, then wait until the sentinels name the
        other server. Its port, and when the act began and the sentinels named it (time.time())."""
        old = self.primary()
        wait_for(lambda: self._settled(old), timeout, f"the group around port {old} to settle")
        acted = time.time()
        act(old)
        new = next(port for port in self.servers if port != old)
        wait_for(lambda: self._named(new), timeout, f"the sentinels to promote port {new}")
        self.failovers += 1
        return new, acted, time.time()

    def failover(self, timeout: float = 60) -> tuple[int, float, float]:
        """``SENTINEL FAILOVER``: as ``_switch``."""
        return self._switch(
            lambda old: self._ask(self.sentinel_ports[0], "SENTINEL", "FAILOVER", self.SERVICE), timeout
        )

    def kill_primary(self, timeout: float = 60) -> tuple[int, float, float]:
        """SIGKILL the primary; once the sentinels promoted the replica, start the killed server
        again (the sentinels make it a replica of the new primary). As ``_switch``."""
        killed: list[int] = []

        def kill(old: int) -> None:
            self.servers[old].kill()
            killed.append(old)

        switched = self._switch(kill, timeout)
        self.servers[killed[0]].start()
        return switched

    def kill(self) -> None:
        self.stop_sentinels()
        for server in self.servers.values():
            server.kill()

    def cleanup(self) -> None:
        """Kill the group's processes (only those this object started); remove the temp dir if
        this object created it."""
        self.kill()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


# -- beanstalkd ---------------------------------------------------------------------------------


class PrivateBeanstalkd:
    """beanstalkd with its binlog in ``directory`` (``-b``). ``restart`` is SIGKILL + a start
    that replays the binlog."""

    def __init__(self, directory: Path | None = None) -> None:
        self.port = free_port()
        self.host = "127.0.0.1"
        self.address = ("127.0.0.1", self.port)
        self._own_directory = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="beanstalkdprivate-")) if directory is None else directory
        self.binlog = self.directory / "binlog"
        self.binlog.mkdir(parents=True, exist_ok=True)
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        _at_exit(self.kill)  # never outlive this process, even without a cleanup()

    def start(self) -> None:
        binary = shutil.which("beanstalkd")
        if not binary:
            raise RuntimeError("beanstalkd is not on PATH")
        self.starts += 1
        log = open(self.directory / f"beanstalkd-{self.starts}.log", "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            [binary, "-l", "127.0.0.1", "-p", str(self.port), "-b", str(self.binlog)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._serving, 60, f"the private beanstalkd on port {self.port}")

    def _serving(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"beanstalkd exited ({self.popen.returncode}): see {self.directory}")
        return accepts(self.address)

    def kill(self) -> None:
        sigkill(self.popen)

    def restart(self, outage: float = 1.0) -> tuple[float, float]:
        """SIGKILL, ``outage`` seconds down, a start that replays the binlog."""
        down = time.time()
        self.kill()
        time.sleep(outage)
        self.start()
        return down, time.time()

    def cleanup(self) -> None:
        """Kill this server (only the process this object started); remove the temp dir if
        this object created it. Idempotent."""
        self.kill()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
