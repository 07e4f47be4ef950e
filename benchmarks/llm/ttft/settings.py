"""What the TTFT benchmarks share: the strategies and how they are named, the emulated links
(the GPU systems whose bytes per FLOP they copy, the tbf settings), and the FLOPs and bytes of a
prefill or decode step of a Llama model under a strategy (pure functions, no jax state)."""

from __future__ import annotations

TP = 3
LINKS = ("pcie", "nvlink")
DEFAULT_STRATEGIES = "exact,exact-bf16,int8,int4,int4/8,overlap,overlap+int8,auto"
#: With ``--transport shm``.
SHM_STRATEGIES = "exact,exact-shm,int8,int4,overlap,overlap+int8,auto"
TRANSPORTS = ("xla", "shm")
# GPU systems whose ratio of link bandwidth to compute the emulated links copy (assumptions,
# docs/ttft.md): all-reduce bus bandwidth NCCL achieves, dense bf16 tensor-core peak.
SYSTEMS = {
    "pcie": {"system": "NVIDIA L40 + PCIe Gen4 x16", "bus_bytes_per_s": 25e9,
             "flops_per_s": 181e12},
    "nvlink": {"system": "NVIDIA A100 SXM4 + NVLink 3", "bus_bytes_per_s": 230e9,
               "flops_per_s": 312e12},
}
# tbf: the bucket must hold one packet of lo's MTU or such packets are dropped, and tokens
# pile up in it while the ranks compute: a bucket of 128 KB (lo's default 64 KiB MTU) let up to
# 128 KB of every collective through at once, a credit no real link gives (first run: TTFTs
# 0.7-1 s below "unlimited + bytes / rate"). So lo's MTU is set to 1500 and the bucket to 16 KB
# (4 ms at the PCIe-class rate). A long latency (queue limit = rate x latency) keeps TCP from
# losing packets at low rates.
LO_MTU, BURST, TBF_LATENCY = 1500, "16kb", "2s"


#: The exact strategy whose all-reduces move bf16 (benchmarks/collectives/bf16_baseline.py): the
#: baseline of a GPU user, whose exact all-reduce moves bf16 activations.
BF16_BASELINE = "exact-bf16"


def parse_strategies(text: str, transport: str = "xla") -> list:
    """``[(name, TPComm)]`` of a comma-separated list (``models.cli.parse_setting``,
    :data:`BF16_BASELINE` and, with ``transport="shm"``, ``exact-shm``); exact first (the
    calibration is relative to it). Every strategy's config takes ``transport`` (module
    docstring)."""
    from benchmarks.collectives.bf16_baseline import Bf16WireComm
    from models.cli import parse_setting

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--strategies is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"--strategies repeats a name: {text!r}")
    if "exact" in names:
        names.remove("exact")
    if transport not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {TRANSPORTS}, got {transport!r}")
    if "exact-shm" in names and transport != "shm":
        raise ValueError("exact-shm needs --transport shm")
    out = []
    for n in ["exact"] + names:
        if n == BF16_BASELINE:
            out.append((n, Bf16WireComm()))
            continue
        name, comm = parse_setting("exact" if n == "exact-shm" else n)
        over = "p2p" if transport == "shm" and n != "exact" else "xla"
        out.append((n, _over(comm, over)))
    return out


def _over(comm, transport: str):
    """``comm`` with its config's transport set to ``transport``."""
    import dataclasses

    from jax_flashcomm.nn import TPComm

    return TPComm(comm.quantization, comm.axis_name, layout=comm.layout,
                  config=dataclasses.replace(comm.config, transport=transport),
                  bidirectional=comm.bidirectional, fuse_norm=comm.fuse_norm)


def parse_links(text: str) -> list[str]:
    links = [s.strip() for s in text.split(",") if s.strip()]
    bad = [x for x in links if x not in LINKS]
    if bad or not links or len(set(links)) != len(links):
        raise ValueError(f"--links: choose distinct names among {', '.join(LINKS)}, got {text!r}")
    return links


def prefill_flops(cfg, seq: int, batch: int = 1) -> float:
    """FLOPs (2 per multiply-add) of one prefill of ``seq`` positions as the engine executes
    it: the projections and MLP of every position, attention scores and values over all
    ``seq`` keys (computed, then masked), the LM head of the last position. Norms, RoPE and
    softmax are left out (O(seq d), under 1%)."""
    attention = 2 * 2 * seq * seq * cfg.n_heads * cfg.head_dim
    return float(block_matmul_flops(cfg, seq, batch)
                 + batch * (cfg.n_layers * attention + 2 * cfg.d_model * cfg.vocab_size))


def block_matmul_flops(cfg, seq: int, batch: int = 1) -> float:
    """FLOPs of the blocks' projections and MLPs in one prefill of ``seq`` positions (the
    matmuls the row- and column-parallel layers run)."""
    d, dh, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    q, kv = cfg.n_heads * dh, cfg.n_kv_heads * dh
    per_token = 2 * d * (q + 2 * kv) + 2 * q * d + 2 * d * 2 * f + 2 * f * d
    return float(batch * cfg.n_layers * seq * per_token)


def link_rate(achieved_flops_per_s: float, system: dict) -> float:
    """Aggregate loopback rate (bytes/s) whose ratio to the CPU's achieved FLOP/s is the GPU
    system's ratio of per-GPU bus bandwidth to per-GPU FLOP/s. The N ranks share both the
    loopback qdisc and the 2 cores, so N cancels: per rank R/N bytes/s against A/N FLOP/s."""
    if not achieved_flops_per_s > 0:
        raise ValueError(f"achieved FLOP/s must be positive, got {achieved_flops_per_s}")
    return achieved_flops_per_s * system["bus_bytes_per_s"] / system["flops_per_s"]


def _payload(elems: int, bits: int, group: int, spikes: int, multiple: int = 1) -> float:
    """Bytes of one codec payload of ``elems`` values (whole groups, ``multiple`` chunks)."""
    from jax_flashcomm.codec import spec

    return spec.padded_size(elems, group, multiple) * spec.wire_bytes_per_element(
        bits, group, spikes)


def step_traffic(cfg, tp: int, comm, seq: int, *, decode: bool, batch: int = 1,
                 itemsize: int = 4, auto_quantizes=False) -> dict:
    """Bytes each rank sends, and collectives it joins, in one prefill of ``seq`` (padded)
    positions or one decode step, as the model is written (docs/ttft.md "Bytes"):

    * embedding: exact ``psum`` of the (B, S, d) partial lookups (``psum_scatter`` with the
      sequence-parallel overlap kinds); logits of the last position ``all_gather``-ed over the
      vocabulary; with overlap, the final ``all_gather`` of the sequence;
    * per layer, after attention and after the MLP: ``lax.psum`` (exact: a ring, 2 (N-1)/N of
      the operand), the two-step quantized psum ((N-1)/N of each phase's payload, the operand
      padded to N chunks of whole groups), or with overlap an all-gather ring (N-1 permutes of
      this rank's S/N rows; quantized with ``ag_bits`` for overlap+int) before the column
      matmul and a reduce-scatter (ring of N-1 permutes of S/N rows, or the quantized
      ``psum_scatter``: (N-1)/N of the rs payload) after the row matmul.
    A decode step has S = 1 and all-reduces (the overlap kinds too). ``auto`` counts as flash
    where ``auto_quantizes`` (the choice it made for this step's all-reduces), else as exact;
    ``auto+overlap``'s sequence-parallel prefill takes ``{"ag": bool, "rs": bool}`` (whether
    its all-gather rings and its reduce-scatters quantized; a bool: both alike);
    a comm with ``wire_itemsize`` (the bf16 baseline) moves its all-reduces in that many bytes.
    ``{"bytes": total, "blocks": the 2L per-layer collectives' bytes, "collectives": count}``.
    """
    if tp < 2:
        return {"bytes": 0.0, "blocks": 0.0, "collectives": 0}
    n, d, L = tp, cfg.d_model, cfg.n_layers
    s = 1 if decode else seq
    sp = comm.overlap and not decode
    if sp and s % n:
        raise ValueError(f"sequence-parallel prefill needs seq % {n} == 0, got {s}")
    elems = batch * s * d
    act = elems * itemsize
    ring = 2 * (n - 1) / n * act
    if sp:
        fixed, count = (n - 1) / n * act + (n - 1) / n * act, 2   # embed psum_scatter, gather
    else:
        fixed, count = ring, 1                                      # embed psum
    vocab_padded = -(-cfg.vocab_size // n) * n
    fixed += (n - 1) * batch * vocab_padded // n * 4                # logits all_gather (f32)
    count += 1
    c = comm.config
    if comm.kind.startswith("auto"):
        q = auto_quantizes if isinstance(auto_quantizes, dict) else {"ag": bool(auto_quantizes),
                                                                      "rs": bool(auto_quantizes)}
    else:
        q = {"ag": comm.quantized, "rs": comm.quantized}
    if sp:  # an all-gather ring before the column matmul, a reduce-scatter after the row one
        ag = (n - 1) * (_payload(elems // n, c.phase2_bits, c.group_size, c.phase2_spikes)
                        if q["ag"] else act / n)
        rs = ((n - 1) / n * _payload(elems, c.phase1_bits, c.group_size, c.phase1_spikes, n)
              if q["rs"] else (n - 1) * act / n)   # the quantized psum_scatter, or a ring
        block, per = ag + rs, (n - 1) + (1 if q["rs"] else n - 1)
    elif q["rs"]:  # the two-step quantized all-reduce
        block = (n - 1) / n * (_payload(elems, c.phase1_bits, c.group_size, c.phase1_spikes, n)
                               + _payload(elems, c.phase2_bits, c.group_size, c.phase2_spikes, n))
        per = 2
    else:
        wire = getattr(comm, "wire_itemsize", None)           # bf16 baseline: two collectives
        block, per = (ring, 1) if wire is None else (ring * wire / itemsize, 2)
    blocks = 2 * L * block
    return {"bytes": fixed + blocks, "blocks": blocks, "collectives": count + 2 * L * per}


def strategy_fields(name: str, comm) -> dict:
    """The row fields that describe a strategy."""
    q = comm.quantized
    return {"strategy": name, "kind": comm.kind,
            "rs_bits": comm.config.phase1_bits if q else None,
            "ag_bits": comm.config.phase2_bits if q else None,
            "group_size": comm.config.group_size if q else None,
            "spikes": [comm.config.phase1_spikes, comm.config.phase2_spikes] if q else None}
