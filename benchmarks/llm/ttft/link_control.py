"""The emulated links of the TTFT benchmark, as its processes see them: process 0 sets the
network namespace's loopback qdisc (``tc tbf``) between measurements, with barriers around each
change; every process checks the link it gets (a 4-byte psum for latency, a 1 MiB-per-rank psum
for rate) and prices it for the automatic choice."""

from __future__ import annotations

import os
import statistics
import subprocess
import time

from benchmarks.llm.ttft import settings


def _namespace() -> str:
    """The name of the network namespace this process is in; refuses to touch ``tc`` outside
    one of the benchmark's own (benchmarks/shared/netns.py names them ``flashcomm-...``)."""
    name = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                          text=True, timeout=30).stdout.strip()
    if not name.startswith("flashcomm-"):
        raise RuntimeError(f"ttft links worker: not inside a benchmark namespace ({name!r}); "
                           f"refusing to change a qdisc")
    return name


def set_qdisc(rate_bytes_per_s: float | None) -> None:
    """No qdisc on lo (None) or ``tc tbf`` at ``rate_bytes_per_s`` (aggregate, both ways)."""
    _namespace()
    if rate_bytes_per_s is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True,
                       timeout=30)  # fails harmlessly when there is none
        return
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate",
                    f"{int(rate_bytes_per_s * 8)}bit", "burst", settings.BURST, "latency",
                    settings.TBF_LATENCY], check=True, capture_output=True, text=True, timeout=30)


class EmulatedLinks:
    """The link this process runs on now (``current``), the set rate of each
    (``rates``: None for no limit) and what was measured on each (``link_info``)."""

    def __init__(self, mesh, pid: int, shm, log):
        import jax
        from jax import lax
        from jax.sharding import PartitionSpec as P

        self.mesh, self.pid, self.nproc, self.shm, self.log = mesh, pid, mesh.size, shm, log
        # link checks: a 4-byte psum (latency) and a 1 MiB-per-rank f32 psum (rate, as a ring)
        self.psum = jax.jit(jax.shard_map(lambda v: lax.psum(v, "tp"), mesh=mesh,
                                          in_specs=P("tp"), out_specs=P()))
        self.small, self.big = self._global_ones(1), self._global_ones(256 * 1024)
        jax.block_until_ready((self.psum(self.small), self.psum(self.big)))
        self.rates = {"unlimited": None}
        self.link_info: dict = {}
        self.current = "(start)"

    def _global_ones(self, n_elems):
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return jax.make_array_from_process_local_data(
            NamedSharding(self.mesh, P("tp")), np.ones((1, n_elems), np.float32),
            (self.nproc, n_elems))

    def link_check(self) -> dict:
        import jax

        lat = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(self.psum(self.small))
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(self.psum(self.big))
        dt = time.perf_counter() - t
        n = self.nproc
        sent = n * 2 * (n - 1) / n * self.big.nbytes / n   # all ranks, ring
        return {"small_psum_s": statistics.median(lat), "big_psum_s": dt,
                "measured_bytes_per_s": sent / dt}

    def use_link(self, name: str) -> None:
        from jax.experimental import multihost_utils

        if self.current == name:
            return
        multihost_utils.sync_global_devices(f"before {name}")
        if self.pid == 0:
            set_qdisc(self.rates[name])
        if self.shm is not None:  # the same link, emulated for shared memory
            self.shm.set_link_rate(self.rates[name] or 0.0)
        multihost_utils.sync_global_devices(f"after {name}")
        self.current = name
        if name not in self.link_info:
            info = self.link_info[name] = {"rate_bytes_per_s": self.rates[name],
                                           **self.link_check()}
            self.log(f"link {name}: psum-measured {info['measured_bytes_per_s'] / 1e6:.2f}"
                     f" MB/s, 4-byte psum {info['small_psum_s'] * 1e3:.2f} ms")

    def profile(self, name: str):
        """The link the automatic choice prices: process 0's measurement of it (every process
        must make the same choice), shared by the ranks: the tc rate, or with no limit the
        psum-measured rate; the 4-byte psum's time as the latency of one collective."""
        import numpy as np
        from jax.experimental import multihost_utils

        from jax_flashcomm.costs import Link

        info = self.link_info[name]
        mine = np.array([info["rate_bytes_per_s"] or info["measured_bytes_per_s"],
                         info["small_psum_s"]], np.float64)
        rate, lat = (float(v) for v in multihost_utils.broadcast_one_to_all(mine))
        return Link(rate, "shared", lat)


def calibration_text(name: str, compute: dict) -> str:
    """How the set rate of the link ``name`` was chosen, in words."""
    if name == "unlimited":
        return "no qdisc on the namespace's loopback (gloo over TCP on 127.0.0.1)"
    s = settings.SYSTEMS[name]
    return (f"aggregate tbf rate = {s['system']}: {s['bus_bytes_per_s'] / 1e9:g} GB/s "
            f"all-reduce bus bandwidth / "
            f"{s['flops_per_s'] / 1e12:g} TFLOP/s dense bf16 = "
            f"{s['bus_bytes_per_s'] / s['flops_per_s']:.3g} B/FLOP, times the measured "
            f"{compute['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s of the exact prefill with no "
            f"limit")
