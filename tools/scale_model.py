#!/usr/bin/env python3
"""Per-call time of the DeepSeek-V3 MoE layer at expert parallelism 1-64: floors plus measured overheads.

    tools/scale_model.py [--gpus-per-node 8] [--nic-gbits 400] [--nic-efficiency 0.85]
                         [--net-latency-us 5] [--nvlink-gbps G] [--routing uniform|groups4]
                         [--results DIR] [--json FILE]

The design it models is docs/scale-out.md: ranks of one node reach each other by NVLink loads and
stores (LSA), ranks of other nodes through NCCL's GPU-initiated networking (GIN) on their rail; a
token crosses the network once per destination node (to the rail peer there, which the owners of its
experts pull it from), and an expert's result comes back as one partial sum per (token, node).

Every term is a floor (bytes or FLOPs over a rate) times a measured efficiency, or a measured fixed
cost, all read from bench/results/ when the script starts:
  - the grouped GEMMs: the fp8 rows of gemm-1xh200-*.json (time per launch against experts and
    tokens per expert, interpolated log-log);
  - NVLink pulls: the pull_ld rows of comm-2xh200-*.json (rate against bytes);
  - the cross-rank barrier: the barrier row of comm-2xh200-*.json;
  - HBM and FP8 ceilings: the layer-*xh200-*.json files' same-run ceilings;
  - one fixed per-call cost (launches, prologues, first round trips), fitted to the committed 1- and
    2-GPU layer rows (layer-1xh200-*.json, layer-2xh200-*.json) so that the largest relative error
    over those rows is smallest.
The network terms (NIC line rate, efficiency, one-way latency) are parameters: nothing here was
measured across nodes. Standard library only.

It prints: the model against every committed 1- and 2-GPU layer row; predictions for EP 2-64 at
1-8192 tokens per rank with their floors; and its predictions beside DeepEP's published internode
and low-latency figures (with DeepEP's hardware: H800, ~160 GB/s NVLink, CX7 400 Gb/s).
"""

import argparse
import glob
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# The tolerance docs/scale-out.md states and tests/scale_model checks: the model against each
# committed 1- and 2-GPU layer row (CUDA-graph time).
CALIBRATION_TOLERANCE = 0.15


# ---- The problem -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    experts: int = 256
    top_k: int = 8
    hidden: int = 7168
    intermediate: int = 2048
    shared: int = 1

    @property
    def row_fp8(self):  # an E4M3 token row and its 1x128 FP32 scales
        return self.hidden + self.hidden / 128 * 4

    @property
    def row_fp8_l2(self):  # an L2 input row (intermediate wide) and its scales
        return self.intermediate + self.intermediate / 128 * 4

    @property
    def row_bf16(self):  # one BF16 result row (a combine slot)
        return self.hidden * 2

    @property
    def route_meta(self):  # what travels with a token over the network: token id, top-k ids and weights
        return 16 + self.top_k * 8

    def expert_bytes(self, intermediate=None):
        """One expert's FP8 weights and their FP32 scales per 64 x 128 (as bench's layer_work counts them)."""
        i = self.intermediate if intermediate is None else intermediate
        h = self.hidden
        return 3 * i * h + 4 * (2 * i / 64 * (h / 128) + h / 64 * (i / 128))

    def flops_per_route(self):
        return 2 * 3 * self.intermediate * self.hidden


DEEPSEEK_V3 = Shape()


# ---- Measurements ------------------------------------------------------------------------------

def _latest(pattern):
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no results file matches {pattern}")
    return files[-1]


def _load(path):
    with open(path) as f:
        return json.load(f)


def _log_interp(xs, ys, x):
    """Piecewise-linear interpolation of log(y) over log(x); linear in x beyond the last point (the
    per-item cost is constant there), flat below the first."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            f = math.log(x / xs[i]) / math.log(xs[i + 1] / xs[i])
            return math.exp(math.log(ys[i]) * (1 - f) + math.log(ys[i + 1]) * f)
    raise AssertionError("unreachable")


@dataclass
class Calibration:
    """What bench/results/ measured, in the form the model uses."""
    gemm_us: dict = field(default_factory=dict)      # (stage, experts) -> ([tokens per expert], [us])
    gemm_experts: list = field(default_factory=list)
    pull_bytes: list = field(default_factory=list)   # NVLink pull of FP8 rows: size -> GB/s
    pull_gbps: list = field(default_factory=list)
    peer_copy_gbps: float = 0.0                      # the comm run's own peer-copy ceiling
    barrier_us: float = 0.0                          # in-kernel cross-rank barrier, two GPUs
    hbm_gbps: float = 0.0                            # HBM copy ceiling (bytes read + written)
    fp8_tflops: float = 0.0                          # dense FP8 ceiling
    layer_rows: list = field(default_factory=list)   # committed 1- and 2-GPU layer rows
    fixed_us: float = 0.0                            # fitted per-call fixed cost
    sources: list = field(default_factory=list)

    @classmethod
    def load(cls, results_dir=RESULTS):
        c = cls()
        gemm_path = _latest(os.path.join(results_dir, "gemm-1xh200-*.json"))
        comm_path = _latest(os.path.join(results_dir, "comm-2xh200-*.json"))
        layer_paths = [_latest(os.path.join(results_dir, f"layer-{g}xh200-*.json")) for g in (1, 2)]
        c.sources = [os.path.relpath(p, ROOT) for p in [gemm_path, comm_path] + layer_paths]

        table = {}
        for r in _load(gemm_path)["rows"]:
            if r["recipe"] == "fp8" and r["routing"] == "uniform":
                table.setdefault((r["stage"], r["experts"]), []).append((r["tokens_per_expert"], r["us"]))
        for key, points in table.items():
            points.sort()
            c.gemm_us[key] = ([p[0] for p in points], [p[1] for p in points])
        c.gemm_experts = sorted({e for (_, e) in c.gemm_us})

        comm = _load(comm_path)
        pulls = sorted((r["bytes"], r["gbps"]) for r in comm["rows"]
                       if r["kind"] == "pull_ld" and r.get("row_bytes") == 7168)
        c.pull_bytes = [p[0] for p in pulls]
        c.pull_gbps = [p[1] for p in pulls]
        c.peer_copy_gbps = comm["ceilings"]["peer_copy_gbps"]
        c.barrier_us = next(r["us"] for r in comm["rows"] if r["kind"] == "barrier")

        hbm, fp8 = [], []
        for path in layer_paths:
            layer = _load(path)
            hbm.append(layer["ceilings"]["hbm_copy_gbps"])
            fp8.append(layer["ceilings"]["fp8_dense_tflops"])
            for r in layer["rows"]:
                # The model is of the staged schedule (the default); a file may hold both schedules' rows.
                if r["recipe"] == "fp8" and r["mode"] == "processes" and r.get("schedule", "staged") == "staged":
                    c.layer_rows.append(r)
        c.hbm_gbps = sum(hbm) / len(hbm)
        c.fp8_tflops = sum(fp8) / len(fp8)
        c.fixed_us = c.fit_fixed()
        return c

    # Time of one grouped-GEMM launch of `experts` experts with `tokens` tokens each, as measured.
    def gemm(self, stage, experts, tokens):
        tokens = max(tokens, 1.0)

        def at(e):
            xs, ys = self.gemm_us[(stage, e)]
            return _log_interp(xs, ys, tokens)

        es = self.gemm_experts
        if experts <= es[0]:
            return at(es[0])
        if experts >= es[-1]:
            return at(es[-1]) * experts / es[-1]
        return _log_interp(es, [at(e) for e in es], experts)

    # Marginal cost of one more expert with `tokens` tokens inside a launch that fills the GPU (the
    # shared expert joins the routed launch): the 128-expert launch's time per expert.
    def gemm_marginal(self, stage, tokens):
        top = self.gemm_experts[-1]
        return self.gemm(stage, top, tokens) / top

    # Time (us) of an NVLink pull of `nbytes` on a link whose peer copy reaches `link_gbps`: the measured
    # pull rate at that size, scaled by the link's speed; below the smallest measured pull, a straight
    # line from one barrier round trip (a lone store and its flag) to that pull's time.
    def nvlink_us(self, nbytes, link_gbps):
        if nbytes <= 0:
            return 0.0
        scale = link_gbps / self.peer_copy_gbps
        xs, ys = self.pull_bytes, self.pull_gbps
        if nbytes < xs[0]:
            smallest = xs[0] / (ys[0] * scale * 1e3)
            return self.barrier_us + (smallest - self.barrier_us) * nbytes / xs[0]
        rate = ys[-1]
        for i in range(len(xs) - 1):
            if xs[i] <= nbytes <= xs[i + 1]:
                f = math.log(nbytes / xs[i]) / math.log(xs[i + 1] / xs[i])
                rate = ys[i] * (1 - f) + ys[i + 1] * f
                break
        return nbytes / (rate * scale * 1e3)

    def fit_fixed(self):
        """The per-call fixed cost that makes the largest relative error over the committed layer rows smallest."""
        hw = Hardware.from_calibration(self)
        best = None
        for tenth in range(0, 1001):
            fixed = tenth / 10
            worst = max(abs(predict(self, hw, r["ranks"], r["tokens_per_rank"], fixed_us=fixed).staged_us
                            / r["graph_us"] - 1) for r in self.layer_rows)
            if best is None or worst < best[0]:
                best = (worst, fixed)
        return best[1]


# ---- Hardware ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    hbm_gbps: float = 4200.0        # HBM copy, bytes read + written
    fp8_tflops: float = 1480.0      # dense FP8
    nvlink_gbps: float = 391.0      # per GPU and direction (peer copy)
    nic_gbits: float = 400.0        # per GPU
    nic_efficiency: float = 0.85    # fraction of the line rate GIN puts of ~7-14 KB rows reach (assumed)
    net_latency_us: float = 5.0     # one-way: a put with its signal, until the peer sees the signal (assumed)

    @property
    def nic_gbps(self):
        return self.nic_gbits / 8

    @classmethod
    def from_calibration(cls, c, **overrides):
        hw = cls(hbm_gbps=c.hbm_gbps, fp8_tflops=c.fp8_tflops, nvlink_gbps=c.peer_copy_gbps)
        return replace(hw, **overrides)


# ---- Routing -----------------------------------------------------------------------------------

def _comb(n, k):
    return math.comb(int(n), int(k)) if 0 <= k <= n else 0


@dataclass
class Traffic:
    nodes: int
    node_ranks: int           # ranks per node in use
    active_experts: float     # per rank
    tokens_per_expert: float  # per active expert
    routes: float             # routes each rank sends and receives
    nvlink_routes: float      # of those, received from (or pulled through) another GPU of the node
    local_routes: float       # received from this GPU's own buffer (own tokens, or its own inbox)
    nodes_per_token: float    # distinct nodes a token's experts are on (DeepEP's "RDMA tokens" per token)
    remote_nodes_per_token: float
    gpus_per_token: float     # distinct GPUs a token's experts are on


def traffic(shape, ranks, tokens, gpus_per_node, routing="uniform"):
    if ranks > gpus_per_node and ranks % gpus_per_node:
        raise ValueError(f"{ranks} ranks do not fill nodes of {gpus_per_node} GPUs")
    nodes = max(1, ranks // gpus_per_node) if ranks > gpus_per_node else 1
    node_ranks = ranks // nodes
    e, k = shape.experts, shape.top_k
    per_node = e / nodes
    per_rank = e / ranks
    if routing == "uniform":  # k distinct experts, uniformly (the layer benchmark's routing)
        nodes_per_token = nodes * (1 - _comb(e - per_node, k) / _comb(e, k))
        gpus_per_token = ranks * (1 - _comb(e - per_rank, k) / _comb(e, k))
    elif routing == "groups4":  # DeepSeek-V3's group-limited routing with a group per node: k experts within 4 nodes
        m = min(4, nodes)
        nodes_per_token = m * (1 - _comb((m - 1) * per_node, k) / _comb(m * per_node, k))
        gpus_per_token = m * node_ranks * (1 - _comb(m * per_node - per_rank, k) / _comb(m * per_node, k))
    else:
        raise ValueError(f"unknown routing {routing}")
    remote_nodes = nodes_per_token * (nodes - 1) / nodes
    routes = tokens * k
    active = per_rank * (1 - (1 - k / e) ** (tokens * ranks)) if tokens > 0 else 0.0
    # A received route comes from a source (or, across nodes, through a proxy: the source's rail
    # peer in this node); that GPU is this one with probability 1 / node_ranks.
    nvlink_routes = routes * (node_ranks - 1) / node_ranks
    return Traffic(nodes=nodes, node_ranks=node_ranks, active_experts=active,
                   tokens_per_expert=routes / active if active > 0 else 0.0, routes=routes,
                   nvlink_routes=nvlink_routes, local_routes=routes - nvlink_routes,
                   nodes_per_token=nodes_per_token, remote_nodes_per_token=remote_nodes,
                   gpus_per_token=gpus_per_token)


# ---- The model ---------------------------------------------------------------------------------

@dataclass
class Prediction:
    ranks: int
    tokens: int
    traffic: Traffic
    floors: dict        # us: weights (HBM), hbm (all HBM bytes), compute, nvlink, network
    terms: dict         # us: every term of the staged sum
    staged_us: float    # today's kernel sequence, with a network stage where ranks span nodes
    fused_us: float     # the fused kernel with the overlaps docs/scale-out.md allows

    def bound(self):
        names = ("weights", "compute", "nvlink", "network")
        return max(names, key=lambda n: self.floors[n])


def predict(c, hw, ranks, tokens, shape=DEEPSEEK_V3, routing="uniform", fixed_us=None, pull="route"):
    """pull: "route" (today: every route's row crosses NVLink on its own) or "gpu" (a row crosses
    NVLink once per (token, owner GPU) and is copied locally for the owner's other experts)."""
    fixed = c.fixed_us if fixed_us is None else fixed_us
    t = traffic(shape, ranks, tokens, hw.gpus_per_node, routing)
    k = shape.top_k
    pulled = t.nvlink_routes * (t.gpus_per_token / k if pull == "gpu" else 1.0)
    hbm_us = lambda nbytes: nbytes / (hw.hbm_gbps * 1e3)
    net_gbps = hw.nic_gbps * hw.nic_efficiency

    def nvlink_us(nbytes):
        return c.nvlink_us(nbytes, hw.nvlink_gbps)

    # Floors, per rank (the busiest rank is any rank: routing is uniform).
    weights = t.active_experts * shape.expert_bytes() + (shape.shared * shape.expert_bytes() if tokens else 0)
    hbm_bytes = (weights + tokens * shape.row_fp8 + 2 * t.routes * (shape.row_fp8 + shape.row_fp8_l2)
                 + 2 * tokens * shape.shared * shape.row_fp8_l2 + 2 * (t.routes + tokens * shape.shared) * shape.row_bf16
                 + tokens * shape.row_bf16)
    flops = (t.routes + tokens * shape.shared) * shape.flops_per_route()
    nvlink_bytes = pulled * shape.row_fp8 + t.nvlink_routes * shape.row_bf16
    network_rows = tokens * t.remote_nodes_per_token
    network_bytes = network_rows * (shape.row_fp8 + shape.route_meta + shape.row_bf16)
    floors = {
        "weights": hbm_us(weights),
        "hbm": hbm_us(hbm_bytes),
        "compute": flops / (hw.fp8_tflops * 1e6),
        "nvlink": nvlink_bytes / (hw.nvlink_gbps * 1e3),
        "network": network_bytes / (hw.nic_gbps * 1e3),
    }

    multi = t.nodes > 1
    latency = hw.net_latency_us if multi else 0.0
    terms = {}
    terms["fixed"] = fixed
    # Inputs copied into the symmetric buffer (x, scales, ids, weights), read and written.
    terms["stage"] = hbm_us(2 * tokens * (shape.row_fp8 + 8 * k))
    # Two cross-rank barriers (after the counts, before combine); one node's LSA barrier each.
    terms["barriers"] = 2 * c.barrier_us if ranks > 1 else 0.0
    # Dispatch: rows this GPU copies from its own buffer, rows it pulls over NVLink, rows the
    # network brings to it as a proxy (once per token and node).
    terms["pull_local"] = hbm_us(2 * (t.routes - pulled) * shape.row_fp8)
    terms["pull_nvlink"] = nvlink_us(pulled * shape.row_fp8)
    terms["dispatch_net"] = (network_rows * (shape.row_fp8 + shape.route_meta) / (net_gbps * 1e3) + latency
                             if multi else 0.0)
    # Expert GEMMs: routed experts in one launch per stage, the shared expert joined to it.
    m = t.tokens_per_expert
    a = t.active_experts
    terms["l1"] = c.gemm("l1", a, m) if a > 0 else 0.0
    terms["l2"] = c.gemm("l2", a, m) if a > 0 else 0.0
    terms["shared"] = (c.gemm_marginal("l1", tokens) + c.gemm_marginal("l2", tokens)) * shape.shared if tokens else 0.0
    # Combine: the L2 epilogue's stores to other GPUs of the node run under the L2 GEMM; what does
    # not fit is exposed. Across nodes the proxies sum each token's node-local results and put one
    # BF16 row per (token, node) back.
    comb_nvlink = nvlink_us(t.nvlink_routes * shape.row_bf16)
    terms["combine_nvlink_exposed"] = max(0.0, comb_nvlink - terms["l2"])
    remote_routes = t.routes * (t.nodes - 1) / t.nodes
    terms["proxy_reduce"] = hbm_us(remote_routes * shape.row_bf16 + network_rows * shape.row_bf16) if multi else 0.0
    comb_net = network_rows * shape.row_bf16 / (net_gbps * 1e3) + latency if multi else 0.0
    terms["combine_net"] = comb_net
    slots = (k / t.nodes + t.remote_nodes_per_token + shape.shared) if multi else (k + shape.shared)
    terms["combine_local"] = hbm_us(tokens * (slots + 1) * shape.row_bf16)
    staged = sum(terms.values())

    # Fused: the dispatch's network transfer, the node's pulls and the shared expert (which needs no
    # dispatch) run together; the combine's network transfer streams under the L2 GEMM.
    pulls = terms["pull_local"] + terms["pull_nvlink"]
    fused = (fixed + terms["stage"] + terms["barriers"]
             + max(pulls + terms["shared"] if not multi else pulls, terms["dispatch_net"], terms["shared"])
             + terms["l1"]
             + max(terms["l2"], comb_nvlink, comb_net - latency) + latency
             + terms["proxy_reduce"] + terms["combine_local"])
    if not multi:  # in one node the shared expert stays in the routed launch, as measured
        fused = min(fused, staged)
    return Prediction(ranks=ranks, tokens=tokens, traffic=t, floors=floors, terms=terms,
                      staged_us=staged, fused_us=fused)


# ---- DeepEP's published figures (README.md and docs/legacy.md of deepseek-ai/DeepEP) -----------

# V1 normal kernels: H800 (~160 GB/s NVLink), CX7 400 Gb/s per GPU; 4096 tokens per rank, hidden 7168,
# top-4 groups (one per node), top-8 experts, FP8 dispatch, BF16 combine. "Bottleneck bandwidth" is
# the logical RDMA bytes (one row per token and destination node, its own node included) over time.
DEEPEP_NORMAL_V1 = {16: (43, 43), 32: (58, 57), 64: (51, 50)}
# V2 (NCCL GIN backend): SM90, CX7; 8192 tokens per rank, same model settings; logical bandwidth,
# local rank traffic included. EP 8 x 2 and 8 x 4.
DEEPEP_NORMAL_V2 = {16: (90, 81), 32: (61, 61)}
# V1 low-latency kernels, pure RDMA, H800 + CX7 400 Gb/s; 128 tokens per rank, top-8, FP8 dispatch,
# BF16 combine: latency in us.
DEEPEP_LOW_LATENCY_V1 = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314)}


def comm_phases(c, hw, ranks, tokens, shape=DEEPSEEK_V3, routing="uniform", pull="route"):
    """Our dispatch and combine alone (no GEMM to hide under): us for each, and DeepEP's logical
    bandwidth metric (GB/s) for the same bytes."""
    p = predict(c, hw, ranks, tokens, shape, routing, pull=pull)
    t = p.traffic
    dispatch = max(p.terms["pull_local"] + p.terms["pull_nvlink"], p.terms["dispatch_net"]) + p.terms["barriers"] / 2
    nvl_comb = c.nvlink_us(t.nvlink_routes * shape.row_bf16, hw.nvlink_gbps)
    combine = max(nvl_comb, p.terms["combine_net"]) + p.terms["proxy_reduce"] + p.terms["barriers"] / 2
    logical_rows = tokens * t.nodes_per_token
    return {
        "dispatch_us": dispatch,
        "combine_us": combine,
        "dispatch_logical_gbps": logical_rows * shape.row_fp8 / (dispatch * 1e3),
        "combine_logical_gbps": logical_rows * shape.row_bf16 / (combine * 1e3),
    }


def deepep_hardware(c, hw):
    """DeepEP's published runs: H800 NVLink (~160 GB/s), CX7 400 Gb/s; our efficiencies and latency."""
    return replace(hw, nvlink_gbps=160.0, nic_gbits=400.0)


# ---- Output ------------------------------------------------------------------------------------

EP_SIZES = (2, 4, 8, 16, 32, 64)
TOKEN_SIZES = (1, 8, 32, 128, 512, 2048, 8192)


def calibration_table(c, hw):
    rows = []
    for r in c.layer_rows:
        p = predict(c, hw, r["ranks"], r["tokens_per_rank"])
        rows.append((r["ranks"], r["tokens_per_rank"], r["graph_us"], p.staged_us, p.staged_us / r["graph_us"] - 1))
    return rows


def prediction_table(c, hw, routing="uniform"):
    return [predict(c, hw, ep, tokens, routing=routing) for ep in EP_SIZES for tokens in TOKEN_SIZES]


def deepep_wire_fraction(hw, ep, logical_gbps, shape=DEEPSEEK_V3):
    """The fraction of the NIC's line rate a published logical bandwidth implies once the rows to the
    sender's own node (counted in DeepEP's metric, carried by NVLink) are taken out."""
    t = traffic(shape, ep, 1, hw.gpus_per_node, "groups4")
    return logical_gbps * (t.remote_nodes_per_token / t.nodes_per_token) / hw.nic_gbps


def deepep_table(c, hw):
    dhw = deepep_hardware(c, hw)
    normal = []
    for ep in sorted(set(DEEPEP_NORMAL_V1) | set(DEEPEP_NORMAL_V2)):
        route4k = comm_phases(c, dhw, ep, 4096, routing="groups4")
        gpu4k = comm_phases(c, dhw, ep, 4096, routing="groups4", pull="gpu")
        gpu8k = comm_phases(c, dhw, ep, 8192, routing="groups4", pull="gpu")
        normal.append((ep, route4k, gpu4k, DEEPEP_NORMAL_V1.get(ep), gpu8k, DEEPEP_NORMAL_V2.get(ep)))
    low_latency = []
    for ep in sorted(DEEPEP_LOW_LATENCY_V1):
        ours = comm_phases(c, dhw, ep, 128)
        layer = predict(c, hw, ep, 128)
        low_latency.append((ep, ours, DEEPEP_LOW_LATENCY_V1[ep], layer))
    return normal, low_latency


def report(c, hw, routing, out=sys.stdout):
    w = out.write
    w("Calibration: " + ", ".join(c.sources) + "\n")
    w(f"  HBM copy {c.hbm_gbps:.0f} GB/s, dense FP8 {c.fp8_tflops:.0f} TFLOP/s, peer copy {c.peer_copy_gbps:.0f} GB/s, "
      f"barrier {c.barrier_us:.2f} us, fitted fixed cost per call {c.fixed_us:.1f} us\n")
    w(f"  network (assumed): {hw.nic_gbits:.0f} Gb/s per GPU at {hw.nic_efficiency:.2f} of line rate, "
      f"{hw.net_latency_us:.1f} us one way; {hw.gpus_per_node} GPUs per node, NVLink {hw.nvlink_gbps:.0f} GB/s\n\n")

    w(f"Model against the committed layer rows (DeepSeek-V3, fp8, CUDA graph), tolerance {CALIBRATION_TOLERANCE:.0%}:\n")
    w(f"{'GPUs':>5} {'tokens':>7} {'measured us':>12} {'model us':>9} {'error':>7}\n")
    for ranks, tokens, measured, model, err in calibration_table(c, hw):
        w(f"{ranks:>5} {tokens:>7} {measured:>12.0f} {model:>9.0f} {err:>+7.1%}\n")

    w(f"\nPredictions, DeepSeek-V3 fp8, routing {routing}, per call (us); floors per rank (us):\n")
    w(f"{'EP':>3} {'nodes':>5} {'tokens':>7} | {'staged':>8} {'fused':>8} | {'weights':>8} {'FLOPs':>8} "
      f"{'NVLink':>8} {'network':>8} | bound\n")
    for p in prediction_table(c, hw, routing):
        f = p.floors
        w(f"{p.ranks:>3} {p.traffic.nodes:>5} {p.tokens:>7} | {p.staged_us:>8.0f} {p.fused_us:>8.0f} | "
          f"{f['weights']:>8.1f} {f['compute']:>8.1f} {f['nvlink']:>8.1f} {f['network']:>8.1f} | {p.bound()}\n")
    w("staged: today's kernels in sequence plus a network stage; fused: network under the shared expert, "
      "the node's pulls and L2 (docs/scale-out.md)\n")

    normal, low_latency = deepep_table(c, hw)
    w("\nBeside DeepEP's published figures (DeepEP's hardware: H800 NVLink ~160 GB/s, CX7 400 Gb/s; "
      "top-4 node groups):\n")
    w("Normal (throughput) dispatch / combine, logical GB/s (rows per token and node, own node included);\n"
      "wire: the fraction of line rate DeepEP's dispatch figure implies on the NIC:\n")
    w("ours: the rows cross NVLink once per route (today's pool), or once per (token, GPU):\n")
    w(f"{'':>3} | {'4096 tokens per rank':^46} | {'8192 tokens per rank':^30}\n")
    w(f"{'EP':>3} | {'ours/route':>11} {'ours/GPU':>11} {'DeepEP V1':>11} {'wire':>5} | "
      f"{'ours/GPU':>11} {'DeepEP V2':>11} {'wire':>5}\n")
    pair = lambda a, b: f"{a:>4.0f} / {b:<4.0f}"
    ours = lambda o: pair(o["dispatch_logical_gbps"], o["combine_logical_gbps"])
    for ep, r4, g4, v1, g8, v2 in normal:
        theirs = lambda p: pair(*p) if p else f"{'-':^11}"
        wire = lambda p: f"{deepep_wire_fraction(hw, ep, p[0]):>5.2f}" if p else f"{'-':>5}"
        w(f"{ep:>3} | {ours(r4):>11} {ours(g4):>11} {theirs(v1):>11} {wire(v1)} | {ours(g8):>11} {theirs(v2):>11} {wire(v2)}\n")
    w("Low latency, 128 tokens per rank (uniform routing), dispatch / combine us:\n")
    w(f"{'EP':>3} | {'ours (comm only)':>17} {'DeepEP LL V1':>13} | {'ours, whole layer (H200)':>24}\n")
    for ep, ours, ll, layer in low_latency:
        w(f"{ep:>3} | {ours['dispatch_us']:>7.0f} / {ours['combine_us']:<7.0f} {ll[0]:>5} / {ll[1]:<5} | "
          f"staged {layer.staged_us:>5.0f}, fused {layer.fused_us:>5.0f}\n")
    w("DeepEP LL sends one message per (token, expert) over RDMA even inside a node; ours sends one per "
      "(token, node) and uses NVLink inside the node (EP 8 is one node: no network).\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nvlink-gbps", type=float, default=None, help="per GPU and direction (default: measured peer copy)")
    parser.add_argument("--nic-gbits", type=float, default=400.0)
    parser.add_argument("--nic-efficiency", type=float, default=0.85)
    parser.add_argument("--net-latency-us", type=float, default=5.0)
    parser.add_argument("--routing", choices=("uniform", "groups4"), default="uniform")
    parser.add_argument("--json", help="also write the predictions to this file")
    args = parser.parse_args(argv)

    c = Calibration.load(args.results)
    overrides = dict(gpus_per_node=args.gpus_per_node, nic_gbits=args.nic_gbits,
                     nic_efficiency=args.nic_efficiency, net_latency_us=args.net_latency_us)
    if args.nvlink_gbps:
        overrides["nvlink_gbps"] = args.nvlink_gbps
    hw = Hardware.from_calibration(c, **overrides)
    report(c, hw, args.routing)
    if args.json:
        rows = [{"ep": p.ranks, "nodes": p.traffic.nodes, "tokens_per_rank": p.tokens, "staged_us": p.staged_us,
                 "fused_us": p.fused_us, "floors_us": p.floors, "terms_us": p.terms, "bound": p.bound()}
                for p in prediction_table(c, hw, args.routing)]
        with open(args.json, "w") as f:
            json.dump({"hardware": hw.__dict__, "fixed_us": c.fixed_us, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
