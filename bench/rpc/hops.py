#!/usr/bin/env python3
"""What a hop to an RPC server costs: superfluid with the model's layers here,
on one ggml-rpc-server, and on two (loopback), the same requests on each.

Standard library only. Run through bench/rpc/run.sh, or directly:

    python3 bench/rpc/hops.py --superfluid PATH --rpc-server PATH [--runs 5]

Each configuration serves the same GGUF with the same threads; every request
goes through the OpenAI route (POST /v1/chat/completions, greedy, the end of
turn token biased out so every reply has its full length):

  prefill  a fresh ~400-token prompt, max_tokens 1: prompt tokens / wall
  decode   the same prompt again (cached), 129 tokens against 1: 128 / the
           difference in wall time
  restore  not measured here; see docs/scale.md

The per-hop cost per token is (decode step with RPC - step here) / hops, where
one server is 2 hops a step (there and back) and each further server adds one.
Prints a markdown table and writes bench/results/rpc-<date>.json.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "bench", "peer"))
import bench as peer  # noqa: E402  (the peer benchmark's HTTP helpers and passages)

THREADS = 2
EOS = "2"  # SmolLM2's <|im_end|>


def start_rpc(binary, port, log):
    # Two servers on one machine take turns on the same cores: OpenMP's
    # spinning wait (libgomp spins ~300,000 iterations at each barrier) would
    # have the idle one steal the cores from the busy one, which two hosts
    # never do. The daemon's worker spins as briefly (lane.rs's
    # WORKER_SPINCOUNT).
    env = dict(os.environ, GOMP_SPINCOUNT=os.environ.get("GOMP_SPINCOUNT", "20000"))
    p = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port), "-t", str(THREADS)],
                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return p
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"ggml-rpc-server on {port} did not listen")


def start_daemon(binary, model, tmp, servers, log):
    port = peer.free_port()
    sessions = os.path.join(tmp, f"s{port}")
    args = [binary, "serve", model, "--sessions", sessions, "--socket",
            os.path.join(tmp, f"{port}.sock"), "--web", f"127.0.0.1:{port}",
            "--threads", str(THREADS), "--parallel", "1", "--ctx-size", "4096"]
    if servers:
        args += ["--rpc", ",".join(f"127.0.0.1:{p}" for p in servers)]
    p = subprocess.Popen(args, stdout=log, stderr=log, env=peer.server_env())
    token_file = os.path.join(sessions, "web-token")
    deadline = time.time() + 60
    while time.time() < deadline:
        if os.path.exists(token_file):
            token = open(token_file).read().strip()
            status, body = peer.http_json(port, "GET", "/web/health",
                                          headers={"authorization": f"Bearer {token}"})
            if status == 200 and body.get("lane") == "ready":
                return p, port, token
        time.sleep(0.1)
    raise RuntimeError("the daemon did not become ready")


def chat(port, token, text, max_tokens):
    body = {"model": "default", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "logit_bias": {EOS: -100}}
    t0 = time.perf_counter()
    status, reply = peer.http_json(port, "POST", "/v1/chat/completions", body,
                                   headers={"authorization": f"Bearer {token}"})
    wall = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {reply}")
    return wall, reply["usage"]


def measure(port, token, tag):
    text = peer.passage(f"rpc-{tag}", 18) + " Summarise the document."
    wall_fresh, usage = chat(port, token, text, 1)
    wall_one, _ = chat(port, token, text, 1)
    wall_many, usage_many = chat(port, token, text, 129)
    assert usage_many["completion_tokens"] == 129, usage_many
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "prefill_tps": usage["prompt_tokens"] / wall_fresh,
        "decode_ms_per_token": (wall_many - wall_one) / 128 * 1e3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--superfluid", required=True)
    ap.add_argument("--rpc-server", required=True)
    ap.add_argument("--model", default=peer.DEFAULT_MODEL)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    model = os.environ.get("SUPERFLUID_TEST_MODEL", a.model)
    configs = [("here", 0), ("1 server", 1), ("2 servers", 2)]
    results = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "log"), "w") as log:
        rpc_ports = [peer.free_port(), peer.free_port()]
        rpcs = [start_rpc(a.rpc_server, p, log) for p in rpc_ports]
        try:
            for run in range(a.runs):
                order = configs if run % 2 == 0 else list(reversed(configs))
                for name, n in order:
                    d, port, token = start_daemon(a.superfluid, model, tmp, rpc_ports[:n], log)
                    try:
                        r = measure(port, token, f"{run}-{n}")
                    finally:
                        d.terminate()
                        d.wait()
                    peer.log(f"run {run + 1} {name}: {r}")
                    results[name].append(r)
        finally:
            for p in rpcs:
                p.kill()
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
           for name, rs in results.items()}
    here = med["here"]["decode_ms_per_token"]
    one = med["1 server"]["decode_ms_per_token"]
    two = med["2 servers"]["decode_ms_per_token"]
    per_hop = {"1 server (2 hops a step)": (one - here) / 2,
               "2 servers (3 hops a step)": (two - here) / 3,
               "the second server (1 more hop)": two - one}
    rows = ["| layers on | prefill tok/s | decode ms/token | decode tok/s |", "|---|---:|---:|---:|"]
    for name, _ in configs:
        m = med[name]
        rows.append(f"| {name} | {m['prefill_tps']:.0f} | {m['decode_ms_per_token']:.2f} "
                    f"| {1e3 / m['decode_ms_per_token']:.0f} |")
    rows.append("")
    rows.append("| per hop, per decoded token | ms |")
    rows.append("|---|---:|")
    for k, v in per_hop.items():
        rows.append(f"| {k} | {v:.2f} |")
    print("\n".join(rows))
    report = {"date": datetime.date.today().isoformat(), "runs": a.runs, "threads": THREADS,
              "machine": peer.machine(), "median": med, "per_hop_ms": per_hop, "all": results}
    out = os.path.join(REPO, "bench", "results", f"rpc-{report['date']}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    peer.log(f"wrote {out}")


if __name__ == "__main__":
    main()
