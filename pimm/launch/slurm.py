"""Facts of the Slurm job step a process runs in, and the rendezvous every node of the step
computes the same way from them.

Every node's agent must reach the same rendezvous without talking to the others first, so the
endpoint is a pure function of the allocation: the first node of the step's node list, resolved
to IPv4 (c10d breaks on IPv6 link-local addresses), and a port derived from the job and step ids.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

from pimm.errors import LaunchError

PORT_BASE = 29500  # ports PORT_BASE .. PORT_BASE + 32000: above the usual services, below the ephemeral range


@dataclass(frozen=True)
class SlurmStep:
    """One `srun` step (or the batch script itself, step_id None)."""

    job_id: int
    step_id: int | None
    node_id: int  # 0 .. num_nodes-1 within the step
    num_nodes: int
    num_tasks: int
    nodelist: str

    @classmethod
    def from_env(cls, env: dict | None = None) -> SlurmStep | None:
        """The step this process runs in; None outside Slurm."""
        env = os.environ if env is None else env
        if "SLURM_JOB_ID" not in env:
            return None
        step = env.get("SLURM_STEP_ID")
        in_step = step is not None and step not in ("batch", "extern")

        def number(*names: str, default: int = 1) -> int:
            for name in names:
                if env.get(name, "").split("(")[0].isdigit():
                    return int(env[name].split("(")[0])
            return default

        return cls(
            job_id=int(env["SLURM_JOB_ID"]),
            step_id=int(step) if in_step and step.isdigit() else None,
            node_id=number("SLURM_NODEID", default=0),
            num_nodes=number("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") if in_step
            else number("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
            num_tasks=number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if in_step else 1,
            nodelist=(env.get("SLURM_STEP_NODELIST") if in_step else None) or env.get("SLURM_JOB_NODELIST", ""),
        )

    @property
    def tag(self) -> str:
        """Unique per step of the cluster: names this step's rendezvous and its go marker."""
        return f"{self.job_id}.{self.step_id if self.step_id is not None else 'batch'}"

    def check_one_task_per_node(self, nnodes: int) -> None:
        """torchrun starts the GPU processes: Slurm must start exactly one pimm per node."""
        if self.step_id is None:
            raise LaunchError(
                f"--resources.nnodes {nnodes} inside Slurm job {self.job_id} needs one pimm per node: run it "
                f"under `srun --ntasks-per-node=1 pimm launch --resources.nnodes {nnodes} ...`"
            )
        if self.num_nodes != nnodes:
            raise LaunchError(
                f"--resources.nnodes {nnodes} but this Slurm step spans {self.num_nodes} node(s) "
                f"({self.nodelist}); use --resources.nnodes {self.num_nodes} (or $SLURM_NNODES), or srun -N {nnodes}"
            )
        if self.num_tasks != self.num_nodes:
            raise LaunchError(
                f"this Slurm step runs {self.num_tasks} tasks on {self.num_nodes} node(s); pimm needs exactly one "
                "per node (torchrun starts the processes per GPU): srun --ntasks-per-node=1 ..."
            )

    def rendezvous_port(self) -> int:
        return PORT_BASE + (self.job_id % 2000) * 16 + ((self.step_id or 0) % 16)

    def rendezvous_endpoint(self) -> str:
        """`<ipv4 of the step's first node>:<port>`, the same on every node of the step."""
        return f"{node_ipv4(first_node(self.nodelist))}:{self.rendezvous_port()}"


def _scontrol(*args: str) -> str:
    if shutil.which("scontrol") is None:
        raise LaunchError("scontrol is not on PATH inside the Slurm job: pimm needs it to find the first node")
    done = subprocess.run(["scontrol", *args], check=False, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise LaunchError(f"`scontrol {' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def first_node(nodelist: str) -> str:
    """The first host of a Slurm node list (`n[1-2]`, `gpu[001-004,010]`), as Slurm expands it."""
    hosts = _scontrol("show", "hostnames", nodelist).split()
    if not hosts:
        raise LaunchError(f"the Slurm node list {nodelist!r} names no host")
    return hosts[0]


def node_ipv4(node: str) -> str:
    """The node's address as Slurm reaches it (NodeAddr, which may differ from the node's name),
    resolved to IPv4."""
    fields = dict(item.split("=", 1) for item in _scontrol("show", "node", "-o", node).split() if "=" in item)
    address = fields.get("NodeAddr") or node
    try:
        return socket.getaddrinfo(address, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise LaunchError(
            f"cannot resolve node {node} (NodeAddr {address}) to an IPv4 address for the rendezvous: {exc}"
        ) from None
