"""A real one-host Slurm cluster on loopback for the `test_slurm_*` tests:
munged (reused when one already answers), slurmctld and slurmd from Debian's
packages, with their state, spool and logs in a temporary directory and ports
picked free, so nothing of the machine's own Slurm setup is touched.

Requeued jobs become eligible after the credential lifetime; `cred_expire=5`
(the minimum Slurm accepts) keeps that at seconds instead of two minutes, and
scheduling every second (instead of every 30-60 s) starts them then."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional

from tests.harness.daemons import wait_until
from megaresil.ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def missing_reason() -> Optional[str]:
    """Why a local cluster cannot start here, or None when it can."""
    absent = [name for name in DAEMONS if shutil.which(name) is None
              and not Path(f"/usr/sbin/{name}").exists()]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} missing): apt-get install "
                "slurmctld slurmd slurm-client munge (make test does this as root)")
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their users)"
    return None


def _conf(directory: Path, host: str) -> str:
    cpus = os.cpu_count() or 1
    return f"""ClusterName=megaresiltest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=cred_expire=5
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
JobRequeue=1
ReturnToService=2
KillWait=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class LocalSlurm:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.host = socket.gethostname().split(".")[0]
        self.conf = directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.started_munged = False

    def start(self) -> "LocalSlurm":
        for sub in ("state", "spool"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_conf(self.directory, self.host))
        self._ensure_munged()
        self._run("slurmctld", "-f", str(self.conf))
        self._run("slurmd", "-f", str(self.conf), "-N", self.host)
        self._wait_node_idle()
        return self

    def _ensure_munged(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return
        for path in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
            Path(path).mkdir(parents=True, exist_ok=True)
            shutil.chown(path, "munge", "munge")
        self._run("runuser", "-u", "munge", "--", "munged")
        self.started_munged = True

    def _run(self, *argv: str) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}\n{self.logs()}")
        return done.stdout

    def _wait_node_idle(self, timeout: float = 60) -> None:
        wait_until(lambda: self._node_state() in ("idle", "mixed", "allocated"), timeout, 0.5,
                   lambda: f"the Slurm node did not come up\n{self.logs()}")

    def _node_state(self) -> str:
        return subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env,
                              capture_output=True, text=True).stdout.strip()

    def sbatch(self, *argv: str, env: Optional[dict] = None) -> str:
        done = subprocess.run(["sbatch", "--parsable", *argv], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=60, check=True)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as KEY -> value."""
        out = self._run("scontrol", "show", "job", "-o", job_id)
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def signal_batch(self, job_id: str, sig: str) -> None:
        """What Slurm does at --signal=B:SIG@grace: signal the batch script."""
        self._run("scancel", "--batch", f"--signal={sig}", job_id)

    def wait_done(self, job_id: str, timeout: float) -> dict[str, str]:
        def finished() -> Optional[dict[str, str]]:
            info = self.job(job_id)
            return info if info["JobState"] in ENDED else None

        return wait_until(finished, timeout, 0.5, lambda: f"job {job_id} still "
                          f"{self.job(job_id)['JobState']}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                         for p in sorted(self.directory.glob("*.log")))

    def stop(self) -> None:
        subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True)
        for name in ("slurmd", "slurmctld"):
            pid_file = self.directory / f"{name}.pid"
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)
        if self.started_munged:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)
