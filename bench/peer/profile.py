#!/usr/bin/env python3
"""Where each server spends its CPU on the same workload, counted by `perf`.

Starts one server at a time (superfluid, then llama-server), runs bench.py's
warm-up request, then records `perf record -F HZ -p PID` on the process that
computes (superfluid's worker, llama-server itself) over --runs rounds of a
workload, and prints the samples per symbol side by side:

    bench/peer/profile.py --superfluid target/release/superfluid \\
        --llama-server ~/.cache/superfluid/peer/.../llama-server --workload concurrent

Workloads (bench.py's prompts and lengths):
  concurrent  4 sessions, a 219-token prompt and 128 tokens each, at once
  decode      1 session, a 219-token prompt and 128 tokens

Needs `perf` (linux-perf) and the right to profile a child process
(`kernel.perf_event_paranoid` <= 2 for one's own processes). Samples are CPU
time: at -F 1999, 1,999 samples are one second of one thread's CPU.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def child_pids(pid):
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def one_round(who, srv, workload, run):
    if workload == "decode":
        tag = f"p{run}"
        r = bench.sf_single(srv, tag, bench.DECODE_TOKENS) if who == "sf" else \
            bench.ll_single(srv, tag, bench.DECODE_TOKENS)
        return r["ttft_s"]
    results, _ = bench.concurrent_round(who, srv, run, prefix="p")
    return max(r["ttft_s"] for r in results)


def profile(who, binary, model, workload, runs, hz, data):
    workdir = tempfile.mkdtemp(prefix="superfluid-profile-")
    try:
        if who == "sf":
            srv = bench.Superfluid(binary, model, workdir)
            srv.start()
            workers = child_pids(srv.proc.pid)
            if len(workers) != 1:
                raise RuntimeError(f"superfluid: expected one worker, found {workers}")
            pid = workers[0]
            bench.sf_single(srv, "warmup", 16)
        else:
            srv = bench.LlamaServer(binary, model, workdir)
            srv.start()
            pid = srv.proc.pid
            bench.ll_single(srv, "warmup", 16)
        perf = subprocess.Popen(["perf", "record", "-F", str(hz), "-o", data, "-p", str(pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        try:
            for run in range(runs):
                ttft = one_round(who, srv, workload, run)
                bench.log(f"  {who} round {run}: (slowest) first token {ttft:.3f}s")
                time.sleep(2.5)
        finally:
            perf.send_signal(2)
            perf.wait()
        srv.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def samples(data):
    """{symbol: samples} and the total, from `perf report -n`."""
    out = subprocess.run(["perf", "report", "-i", data, "-n", "--sort", "symbol", "--stdio"],
                         capture_output=True, text=True, check=True).stdout
    counts, total = {}, 0
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 4 or not parts[0].endswith("%") or not parts[1].isdigit():
            continue
        n = int(parts[1])
        sym = parts[3].split("  ")[0].strip()
        counts[sym] = counts.get(sym, 0) + n
        total += n
    return counts, total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--superfluid", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default=os.environ.get("SUPERFLUID_TEST_MODEL", bench.DEFAULT_MODEL))
    ap.add_argument("--workload", choices=["concurrent", "decode"], default="concurrent")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--hz", type=int, default=1999)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--also", action="append", default=[],
                    help="also list every symbol containing this text (repeatable), "
                         "e.g. superfluid:: for superfluid's own code")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("profile.py: needs `perf` (apt install linux-perf)")
    tmp = tempfile.mkdtemp(prefix="superfluid-perf-")
    # The benchmark's own rule: the binary is copied first, so a rebuild
    # mid-run does not change it.
    sf_bin = os.path.join(tmp, "superfluid")
    shutil.copy2(args.superfluid, sf_bin)
    data = {"sf": os.path.join(tmp, "sf.data"), "ll": os.path.join(tmp, "ll.data")}
    profile("sf", sf_bin, args.model, args.workload, args.runs, args.hz, data["sf"])
    profile("ll", args.llama_server, args.model, args.workload, args.runs, args.hz, data["ll"])
    sf, sf_total = samples(data["sf"])
    ll, ll_total = samples(data["ll"])
    names = sorted(set(sf) | set(ll), key=lambda k: -(sf.get(k, 0) + ll.get(k, 0)))
    names = names[:args.top] + [k for k in names[args.top:] if any(a in k for a in args.also)]
    print(f"{args.workload}, {args.runs} rounds, perf record -F {args.hz}; samples per symbol "
          f"(the top {args.top}" + "".join(f", and those containing `{a}`" for a in args.also) + ")")
    print()
    print("| symbol | superfluid worker | llama-server | difference |")
    print("|---|---:|---:|---:|")
    print(f"| all | {sf_total} | {ll_total} | {sf_total - ll_total:+d} |")
    for k in names:
        a, b = sf.get(k, 0), ll.get(k, 0)
        print(f"| `{k}` | {a} | {b} | {a - b:+d} |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
