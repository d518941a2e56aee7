"""A real single-node SLURM on this host for the tests (tests/zoo/test_slurm.py): munged, slurmctld and slurmd started
from config files in a temporary directory, stopped by pid afterwards. It installs nothing: where slurm-wlm or munge
is missing the fixture fails with one line saying `apt-get install slurm-wlm munge` (.ci/run installs them); a
test skipped in CI tests nothing.

    python tests/slurm_cluster.py        # the same cluster by hand: prints `export SLURM_CONF=...`, Ctrl-C stops it

As root (slurmd runs each job as its submitter): munged as the munge user on its own socket and key, then
slurmctld and slurmd in the foreground on free local ports; `ProctrackType=proctrack/linuxproc`,
`TaskPlugin=task/none` (no cgroups), no accounting (submitit warns that `sacct` has no accounting storage and goes on).
One node, this host, in one partition `debug` with 2 CPUs; the clients find it through SLURM_CONF.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INSTALL = "apt-get install slurm-wlm munge"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
PARTITION = "debug"
CPUS = 2


class ClusterError(RuntimeError):
    """The cluster cannot start here: one line saying why."""


def missing() -> str | None:
    """Why a SLURM cannot start on this host (one line), or None."""
    absent = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} not found): {INSTALL}"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return f"no 'munge' user (munge is not installed): {INSTALL}"
    if os.geteuid() != 0:
        return "the test SLURM starts slurmd, which runs jobs as their user: run the tests as root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


SLURM_CONF = """\
ClusterName=rnnlab-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (120 s by default)
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
# finished jobs stay listed by squeue for an hour: the tests count every job ever submitted
MinJobAge=3600
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName={host} CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """munged, slurmctld and slurmd of one temporary directory; `env` is what a client needs (SLURM_CONF)."""

    def __init__(self, root: Path | None = None):
        self._made = root is None  # a directory of our own: removed by stop()
        self.root = Path(root or tempfile.mkdtemp(prefix="rnnlab-slurm-"))
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def start(self, timeout: float = 60.0) -> "Cluster":
        why = missing()
        if why:
            raise ClusterError(why)
        try:
            self._write_files()
            self._start_munged()
            self._start("slurmctld", [program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(lambda: self._ask(["scontrol", "ping"]).returncode == 0 and "UP" in self._ask(
                ["scontrol", "ping"]).stdout, timeout, "slurmctld to answer `scontrol ping`", "slurmctld")
            self._start("slurmd", [program("slurmd"), "-D", "-f", str(self.conf), "-N", self.host])
            self._wait(lambda: self.node_state() == "idle", timeout, f"node {self.host} to be idle in sinfo",
                       "slurmd")
        except BaseException:
            self.stop()
            raise
        return self

    def _write_files(self) -> None:
        self.root.chmod(0o755)  # the munge user finds its socket below
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        (self.root / "plugstack.conf").write_text("")
        munge = self.root / "munge"
        munge.mkdir(exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        user = pwd.getpwnam("munge")
        for path in (munge, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        munge.chmod(0o755)  # munged wants its socket's dir searchable by all and writable by munge alone
        key.chmod(0o400)  # and a key no one else reads
        self.conf.write_text(SLURM_CONF.format(host=self.host, ctld_port=free_port(), slurmd_port=free_port(),
                                               munge_socket=self.munge_socket, root=self.root, cpus=CPUS,
                                               memory=max(memory_mb() - 512, 512), partition=PARTITION))

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        self._start("munged", [program("munged"), "-F", f"--socket={self.munge_socket}",
                               f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
                    user="munge", group="munge")
        self._wait(lambda: self.munge_socket.exists(), 30, "munged's socket", "munged")

    def _start(self, name: str, cmd: list[str], **popen) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.client_env(), start_new_session=True, **popen)
        log.close()

    def _wait(self, ready, timeout: float, what: str, name: str) -> None:
        until = time.time() + timeout
        while time.time() < until:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ClusterError(f"{name} exited with {proc.returncode} before {what}: {self._last_lines(name)}")
            if ready():
                return
            time.sleep(0.25)
        raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}: {self._last_lines(name)}")

    def _last_lines(self, name: str) -> str:
        lines = []
        for path in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log",
                     self.root / "munge" / f"{name}.log"):
            try:
                lines += [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
            except OSError:
                pass
        errors = [line for line in lines if "error" in line.lower()] or lines
        return errors[-1].strip()[:300] if errors else f"no log (see {self.root / 'log'})"

    def _ask(self, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, env=self.client_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, 124, "", "timed out")

    def node_state(self) -> str:
        done = self._ask(["sinfo", "--noheader", "--nodes", self.host, "--format=%T"])
        return done.stdout.strip().rstrip("*~#") if done.returncode == 0 else ""

    def jobs(self) -> list[dict[str, str]]:
        """Every job the controller knows (finished ones for MinJobAge): id, name, state."""
        done = self._ask(["squeue", "--noheader", "--states=all", "--format=%i|%j|%T"])
        return [dict(zip(("id", "name", "state"), line.split("|", 2))) for line in done.stdout.splitlines()
                if line.strip()]

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged by pid (SIGTERM, then SIGKILL)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._ask(["scancel", "--full", f"--user={pwd.getpwuid(os.geteuid()).pw_name}"])
            until = time.time() + timeout
            while time.time() < until and any(j["state"] in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING")
                                              for j in self.jobs()):
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._made:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> int:
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    try:
        cluster = Cluster().start()
    except ClusterError as e:
        print(f"slurm_cluster: {e}", file=sys.stderr)
        return 1
    print(f"export SLURM_CONF={cluster.conf}    # then sinfo, sbatch, python -m rnnlab.zoo run ... --executor slurm")
    print(f"partition {PARTITION}, node {cluster.host}, logs in {cluster.root / 'log'}; Ctrl-C stops it", flush=True)
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
