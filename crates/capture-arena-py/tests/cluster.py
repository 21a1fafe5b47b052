"""Hosts made of network and UTS namespaces on one machine, for tests across hosts.

A :class:`Cluster` makes a switch (a namespace holding a bridge) and one namespace per host, each
with its own hostname (a UTS namespace per process it runs), its own ``/dev/shm`` (a directory of
the machine's, bound over ``/dev/shm`` in a mount namespace per process) and a veth pair into the
switch;
addresses are 10.X.0.N/24 on a subnet picked per cluster. Every neighbour entry is permanent, so a
host cut off from the switch is silent, not unreachable: packets to it are sent and never
answered (what a partition or a dead host looks like from the other side).

Faults, each undone by its pair:

- :meth:`partition` / :meth:`heal`: the host's switch port leaves the bridge; the host keeps its
  carrier (an uplink down somewhere in the fabric);
- :meth:`pull_cable` / :meth:`plug_cable`: the switch side of the host's veth goes down, so the
  host loses its carrier (a cable pulled);
- a process killed with :meth:`kill`.

And one condition, to act in the middle of a transfer rather than after a guessed sleep:
:meth:`shape` caps what the switch sends a host (a token bucket on its port, lifted by
:meth:`unshape`) so that a large read lasts long enough, and :meth:`wait_received` waits until a
host has received so many bytes (its read is under way).

Everything is torn down on exit, even after a failure: processes first (their whole process
group), then the namespaces (which takes their veths with them). Traffic only crosses interfaces
the cluster made. Needs root and ``ip`` (iproute2); :func:`unavailable` says why not. :meth:`shape`
also needs ``tc`` (iproute2) and the kernel's ``tbf`` queueing discipline.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any, Optional


def unavailable() -> Optional[str]:
    """Why a cluster cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the tests as root)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2's ip and util-linux's unshare are needed"
    probe = f"ca-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Cluster:
    """Hosts named by the caller, on one switch. Use as a context manager."""

    def __init__(self, hosts: list[str]) -> None:
        tag = os.getpid() % 100000
        self.tag = f"{tag}"
        self.subnet = 10 + tag % 200
        self.switch = f"ca-sw-{tag}"
        self.hosts = list(hosts)
        self.ns = {h: f"ca-{h}-{tag}" for h in hosts}
        self.addr = {h: f"10.{self.subnet}.0.{i + 1}" for i, h in enumerate(hosts)}
        self.port = {h: f"ca{i}p{tag}"[:15] for i, h in enumerate(hosts)}
        self.procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> "Cluster":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        macs = {}
        for i, h in enumerate(self.hosts):
            ns = self.ns[h]
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            inner = f"ca{i}h{self.tag}"[:15]
            _ip("link", "add", inner, "type", "veth", "peer", "name", self.port[h])
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", self.port[h], "netns", self.switch)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", self.port[h], "master", "br0")
            _ip("-n", self.switch, "link", "set", self.port[h], "up")
            out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "eth0"], capture_output=True, text=True).stdout
            macs[h] = out.split("link/ether", 1)[1].split()[0]
        for h in self.hosts:
            for other in self.hosts:
                if other != h:
                    _ip("-n", self.ns[h], "neigh", "replace", self.addr[other], "lladdr", macs[other], "dev", "eth0", "nud", "permanent")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # The hosts' shared memory, with whatever killed producers left in it.
        for h in self.hosts:
            shutil.rmtree(self.shm(h), ignore_errors=True)

    def shm(self, host: str) -> str:
        """The directory that is ``host``'s ``/dev/shm``."""
        return f"/dev/shm/ca-{self.tag}-{host}"

    def killed(self, p: subprocess.Popen[Any]) -> None:
        """Kills ``p`` (SIGKILL) and removes the arena it leaves behind (a process keeps its pid
        through ip netns exec, unshare and sh's exec; an arena's name starts with that pid)."""
        self.kill(p)
        p.wait(timeout=10)
        for f in glob.glob(f"/dev/shm/ca-{self.tag}-*/capture-arena-{p.pid}-*"):
            os.unlink(f)

    def spawn(self, host: str, argv: list[str], env: Optional[dict[str, str]] = None, **popen: Any) -> subprocess.Popen[Any]:
        """Runs ``argv`` on ``host``: in its network namespace, with its own hostname and its own
        ``/dev/shm`` (shared by the processes of that host only), in a process group of its own
        (so teardown kills everything it started)."""
        shm = self.shm(host)
        setup = f'mkdir -p {shm} && mount --bind {shm} /dev/shm && hostname {host} && exec "$@"'
        cmd = ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "--mount", "--", "sh", "-c", setup, "sh", *argv]
        p = subprocess.Popen(cmd, env=env, start_new_session=True, **popen)
        self.procs.append(p)
        return p

    def kill(self, p: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        os.killpg(p.pid, sig)

    def partition(self, host: str) -> None:
        """Cuts ``host`` off the switch; it keeps its carrier."""
        _ip("-n", self.switch, "link", "set", self.port[host], "nomaster")

    def heal(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port[host], "master", "br0")
        # A port joining a bridge forwards at once (no STP on it); give it a moment.
        time.sleep(0.1)

    def pull_cable(self, host: str) -> None:
        """Takes the switch side of ``host``'s link down: ``host`` loses its carrier."""
        _ip("-n", self.switch, "link", "set", self.port[host], "down")

    def plug_cable(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port[host], "up")
        time.sleep(0.1)

    def shape(self, host: str, mbit: int) -> None:
        """Caps what the switch sends to ``host`` at ``mbit`` Mbit/s (a token bucket on its switch
        port): a read by ``host`` of N bytes then takes at least N * 8 / (mbit * 1e6) seconds."""
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "256kb", "latency", "100ms"]
        r = subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", self.port[host], "root", *tbf], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(
                f"tc qdisc replace ... {' '.join(tbf)}: {r.stderr.strip()} (exit {r.returncode}); the tests that cut a "
                "read in the middle need tc (Debian's iproute2) and the kernel's tbf qdisc (CONFIG_NET_SCH_TBF)"
            )

    def unshape(self, host: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", self.port[host], "root"], capture_output=True)

    def received(self, host: str) -> int:
        """The bytes ``host``'s interface has received so far."""
        out = subprocess.run(["ip", "-n", self.ns[host], "-j", "-s", "link", "show", "eth0"], capture_output=True, text=True, check=True).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def wait_received(self, host: str, since: int, at_least: int, timeout: float = 30.0) -> int:
        """Waits until ``host`` has received ``at_least`` bytes more than ``since`` (a
        :meth:`received` taken before); returns how many more."""
        deadline = time.monotonic() + timeout
        while (got := self.received(host) - since) < at_least:
            if time.monotonic() > deadline:
                raise AssertionError(f"{host} received {got} bytes in {timeout} s, not the {at_least} awaited")
            time.sleep(0.005)
        return got
