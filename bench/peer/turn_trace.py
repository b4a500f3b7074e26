#!/usr/bin/env python3
"""Turn N of a resident conversation, traced stage by stage (issue 12).

Builds one ~2,000-token conversation on each server (bench.py's multiturn
history), then asks --turns more short turns, alternating A/B, and times
each one's first token from the client. For superfluid it also starts the
daemon with `RUST_LOG=superfluid::trace=debug`, which logs one line per stage
of a generation with a wall-clock microsecond stamp (daemon and worker share
the clock), and prints the median time from the request to each stage:

    bench/peer/turn_trace.py --superfluid target/release/superfluid \\
        --llama-server ~/.cache/superfluid/peer/.../llama-server --turns 8

Output: a table on stdout; --out writes the raw stamps as JSON.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

QUESTIONS = [
    "Which part talked about the lens?",
    "Which part talked about the seabirds?",
    "Which part talked about the radio?",
    "Which part talked about the storms?",
    "Which part talked about the museum?",
    "Which part talked about the geologist?",
    "Which part talked about the paraffin?",
    "Which part talked about the supply boat?",
]

STAMP = re.compile(r"trace (\d+) (\S+) gen=(\S+)")


def stamps(log_path, since_us):
    """The trace lines written after `since_us`: [(us, stage, gen)]."""
    out = []
    with open(log_path, "rb") as f:
        for line in f.read().decode(errors="replace").splitlines():
            m = STAMP.search(line)
            if m and int(m.group(1)) >= since_us:
                out.append((int(m.group(1)), m.group(2), m.group(3)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--superfluid", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default=os.environ.get("SUPERFLUID_TEST_MODEL",
                                                      bench.DEFAULT_MODEL))
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply", type=int, default=4, help="tokens per timed reply")
    ap.add_argument("--out", default=None)
    ap.add_argument("--before", default="",
                    help="bench.py workloads to run first on both servers (e.g. decode,concurrent), "
                         "so the conversation lands in a KV cache others have used")
    args = ap.parse_args()

    os.environ["RUST_LOG"] = "warn,superfluid::trace=debug,superfluid::worker=debug"
    workdir = tempfile.mkdtemp(prefix="superfluid-trace-")
    sf_bin = os.path.join(workdir, "superfluid")
    shutil.copy2(args.superfluid, sf_bin)
    sf = bench.Superfluid(sf_bin, args.model, workdir)
    ll = bench.LlamaServer(os.path.abspath(args.llama_server), args.model, workdir)
    rows = {"sf": [], "ll": []}
    try:
        sf.start()
        ll.start()
        for name in filter(None, args.before.split(",")):
            getattr(bench, f"w_{name}")(sf, ll, 1, {"sf": [], "ll": []})
        tag = "t0"
        s = sf.create()
        sf.append(s, 0, bench.SYSTEM.format(tag=tag))
        msgs = [{"role": "system", "content": bench.SYSTEM.format(tag=tag)}]
        for k in range(bench.HISTORY_TURNS):
            sf.turn(s, bench.history_message(tag, k), bench.HISTORY_REPLY)
            msgs.append({"role": "user", "content": bench.history_message(tag, k)})
            h = ll.chat(msgs, bench.HISTORY_REPLY, slot=0)
            msgs.append({"role": "assistant", "content": h["text"]})
        log_path = sf.log.name
        for i in range(args.turns):
            q = QUESTIONS[i % len(QUESTIONS)]
            for who in bench.ab(i):
                if who == "sf":
                    since = time.time_ns() // 1000
                    t0 = time.perf_counter()
                    t0_us = time.time_ns() // 1000
                    r = sf.turn(s, q, args.reply)
                    time.sleep(0.3)  # the log lines reach the file
                    # Each stage up to the first provisional text the
                    # client was sent, named by its occurrence (w_recv#2).
                    stages, seen = {}, {}
                    for us, name, _ in stamps(log_path, since):
                        seen[name] = seen.get(name, 0) + 1
                        stages[f"{name}#{seen[name]}"] = (us - t0_us) / 1000.0
                        if name == "http_provisional":
                            break
                    r["stages_ms"] = stages
                    r["t0"] = t0
                else:
                    msgs.append({"role": "user", "content": q})
                    r = ll.chat(msgs, args.reply, slot=0)
                    msgs.append({"role": "assistant", "content": r["text"]})
                r.pop("text", None)
                rows[who].append(r)
                bench.log(f"turn {i} {who}: ttft {r['ttft_s'] * 1000:.1f} ms, "
                          f"computed {r.get('computed')}")
    finally:
        sf.stop()
        ll.stop()
    sf_ttft = statistics.median(r["ttft_s"] for r in rows["sf"]) * 1000
    ll_ttft = statistics.median(r["ttft_s"] for r in rows["ll"]) * 1000
    print(f"turn N time to first token, median of {args.turns}: superfluid {sf_ttft:.1f} ms, "
          f"llama-server {ll_ttft:.1f} ms, ratio {sf_ttft / ll_ttft:.2f}")
    print(f"llama-server's own prompt timing (ms, median): "
          f"{statistics.median(r['computed'] / r['own_prompt_tps'] * 1000 for r in rows['ll']):.1f}"
          f" for {statistics.median(r['computed'] for r in rows['ll'])} tokens")
    names = []
    for r in rows["sf"]:
        for n in r["stages_ms"]:
            if n not in names:
                names.append(n)
    names.sort(key=lambda n: statistics.median(r["stages_ms"][n] for r in rows["sf"]
                                               if n in r["stages_ms"]))
    print("\n| stage (superfluid) | turns | ms after the append request (median) |"
          "\n|---|---:|---:|")
    for n in names:
        vals = [r["stages_ms"][n] for r in rows["sf"] if n in r["stages_ms"]]
        print(f"| {n} | {len(vals)} | {statistics.median(vals):.1f} |")
    print(f"| first token at the client | {sf_ttft:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
