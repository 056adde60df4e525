"""A real SLURM cluster on this machine, for the cluster tests: one `slurmctld`, two `slurmd`
nodes (n1, n2) on localhost and `munged`, every file under one temporary folder.

`LocalSlurmCluster(folder).start()` writes slurm.conf, starts the daemons and waits until both
nodes are idle; `stop()` stops exactly the daemons it started, by the pids in their pid files
(slurm daemons first, munged last). `env` is the environment that points SLURM's commands at
this cluster (SLURM_CONF) and puts a small `sacct` on PATH: without slurmdbd there is no
accounting, and submitit polls `sacct` for job states, so the stand-in answers its
`JobID|State|NodeList` lines from `scontrol show job`.

`ensure_slurm_installed()` installs Debian's packages when they are missing (root + apt), and
says why it cannot otherwise. See ../shared/reference/slurm-facts.md for the facts behind it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "scontrol", "srun")


def ensure_slurm_installed() -> str | None:
    """None when SLURM and munge are usable; else why they cannot be installed here."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if not missing:
        return None
    if os.geteuid() != 0:
        return f"SLURM is not installed ({', '.join(missing)} missing) and installing it needs root"
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(missing)} missing) and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


SACCT = '''\
#!{python}
"""sacct stand-in for a cluster without accounting: `JobID|State|NodeList` from scontrol."""
import subprocess, sys
ids = [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "-j"]
print("JobID|State|NodeList")
for job in ids:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        job_id = fields.get("JobId", job)
        if fields.get("ArrayJobId") and fields.get("ArrayTaskId"):
            task = fields["ArrayTaskId"]
            job_id = f"{{fields['ArrayJobId']}}_{{task if task.isdigit() else '[' + task.split('%')[0] + ']'}}"
        print(f"{{job_id}}|{{fields.get('JobState', 'UNKNOWN')}}|{{fields.get('NodeList', '(null)')}}")
'''


class LocalSlurmCluster:
    def __init__(self, folder: Path, cpus: int | None = None, port: int = 16817) -> None:
        self.folder = Path(folder)
        self.cpus = cpus or os.cpu_count() or 1
        self.port = port
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.folder / "slurm.conf"
        self.bin = self.folder / "bin"
        self.pid_files: list[Path] = []

    # ------------------------------------------------------------------ set-up
    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{self.bin}:{os.environ.get('PATH', '')}"}

    def _write_files(self) -> None:
        f = self.folder
        for sub in ("state", "spool", "munge", "log", "bin"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(f / "munge", 0o755)
        os.chmod(f, 0o755)
        self.conf.write_text(
            textwrap.dedent(f"""\
            ClusterName=dbsntest
            SlurmctldHost={self.host}(127.0.0.1)
            SlurmctldPort={self.port}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            AuthInfo=socket={f}/munge/munge.socket,cred_expire=10
            CredType=cred/munge
            StateSaveLocation={f}/state
            SlurmdSpoolDir={f}/spool/%n
            SlurmctldPidFile={f}/slurmctld.pid
            SlurmdPidFile={f}/slurmd-%n.pid
            SlurmctldLogFile={f}/log/slurmctld.log
            SlurmdLogFile={f}/log/slurmd-%n.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            MpiDefault=none
            ReturnToService=2
            MinJobAge=600
            KillWait=5
            SchedulerParameters=sched_interval=2
            NodeName=n[1-2] NodeHostname={self.host} NodeAddr=127.0.0.1 Port=[{self.port + 1}-{self.port + 2}] CPUs={self.cpus} RealMemory=4000 State=UNKNOWN
            PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
            """)
        )
        sacct = self.bin / "sacct"
        sacct.write_text(SACCT.format(python=sys.executable))
        sacct.chmod(0o755)

    def _run(self, *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        done = subprocess.run(list(command), env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}{self.logs()}")
        return done

    def start(self) -> LocalSlurmCluster:
        self._write_files()
        f = self.folder
        try:
            self._run(_sbin("mungekey"), "-c", "-f", "-k", str(f / "munge" / "munge.key"))
            self.pid_files.append(f / "munge" / "munged.pid")
            self._run(
                _sbin("munged"),
                "-S",
                str(f / "munge" / "munge.socket"),
                f"--key-file={f}/munge/munge.key",
                f"--log-file={f}/log/munged.log",
                f"--pid-file={f}/munge/munged.pid",
                f"--seed-file={f}/munge/munged.seed",
                "--force",
            )
            self.pid_files.insert(0, f / "slurmctld.pid")
            self._run(_sbin("slurmctld"), "-c", "-f", str(self.conf))
            for node in ("n1", "n2"):
                self.pid_files.insert(0, f / f"slurmd-{node}.pid")
                self._run(_sbin("slurmd"), "-f", str(self.conf), "-N", node)
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        states = ""
        while time.time() < deadline:
            done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True)
            states = done.stdout.strip()
            if done.returncode == 0 and states.count("idle") == 2:
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle after {timeout} s: {states!r}{self.logs()}")

    # ------------------------------------------------------------------ jobs
    def job(self, job_id: str) -> dict[str, str]:
        out = self._run("scontrol", "-o", "show", "job", str(job_id)).stdout.splitlines()[0]
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict[str, str]:
        deadline = time.time() + timeout
        info: dict[str, str] = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {info.get('JobState')}{self.logs()}")

    def logs(self, tail: int = 40) -> str:
        text = ""
        for log in sorted((self.folder / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail:]
            text += f"\n--- {log.name} (last {len(lines)} lines)\n" + "\n".join(lines)
        return text

    # ------------------------------------------------------------------ tear-down
    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop the daemons this object started (slurm first,
        munged last), by their pid files."""
        if self.pid_files and self.conf.is_file():
            subprocess.run(
                ["scancel", "--full", "--user", str(os.getuid())], env=self.env, capture_output=True, timeout=30
            )
            deadline = time.time() + 20
            while time.time() < deadline:
                queue = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=30)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.5)
        for pid_file in list(self.pid_files):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.time() + 15
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.pid_files.clear()
