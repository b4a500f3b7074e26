#!/usr/bin/env python3
"""superfluid against llama.cpp's llama-server, side by side.

Standard library only. Run through bench/peer/run.sh, which builds both
servers first; or directly:

    python3 bench/peer/bench.py --superfluid PATH --llama-server PATH [--runs 5] [--quick]

Both servers serve the same GGUF with the same threads, context size and
number of parallel sequences, on loopback,.
Both stay up for the whole run; every workload runs each server in turn,
alternating which goes first (A/B), and the table reports medians,
min-max and the ratio superfluid / llama-server.

In the first five workloads superfluid is driven through its browser
transport (POST /web/rpc and the SSE stream POST /web/stream with
provisional text), llama-server through POST /v1/chat/completions
(streamed, cache_prompt) and /slots. The oai-* workloads drive both
through the same OpenAI route with the same request bodies.

Workloads (see docs/benchmarks.md):
  decode      one stream: ~200-token prompt, 128 greedy tokens
  concurrent  4 streams at once, aggregate generated tokens/s
  multiturn   time to first token of turn N after ~2,000 tokens of history
  fanout      a ~2,000-token document, then 4 questions (forks vs requests)
  restart     stop both servers, start again, ask turn N+1
The OpenAI route, both servers alike (POST /v1/chat/completions, stream,
stream_options.include_usage, identical bodies; llama-server's also carry
cache_prompt, its default):
  oai-decode     one stream: ~200-token prompt, 128 greedy tokens
  oai-multiturn  a chat resending its growing history; TTFT of turn N
  oai-fanout     4 requests sharing a ~2,000-token system+document prefix,
                 sent together; prompt tokens computed and wall time
"""

import argparse
import datetime
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_MODEL = os.path.expanduser("~/.cache/superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf")

THREADS = 2
CTX = 16384          # 4 sequences x (~2,200-token fanout prompt) must fit in both
PARALLEL = 4
DECODE_TOKENS = 128
HISTORY_TURNS = 4    # turns before turn N; each a ~440-token user message
HISTORY_REPLY = 48   # tokens per history reply
TURN_N_REPLY = 16
FANOUT_REPLY = 64

GREEDY = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0, "seed": 1}

# ---- text -------------------------------------------------------------------

SENTENCES = [
    "The lighthouse stood on a spur of black rock where the current turned twice a day.",
    "Its keeper logged the wind, the swell and every ship that passed within sight of the lamp.",
    "In winter the supply boat came once a fortnight, weather permitting, and often it did not.",
    "The lens was a first-order Fresnel lens, ground in Paris and shipped in forty crates.",
    "A clockwork mechanism turned it, and the keeper wound the weights every four hours.",
    "Paraffin replaced whale oil in the eighteen-seventies, and electricity came much later.",
    "Fog was the real enemy: a light that cannot be seen is no better than no light at all.",
    "So the station also had a horn, driven by compressed air from a small steam engine.",
    "The keeper's daughter kept the accounts and knew the tide tables better than her father.",
    "Storms in the autumn could throw spray over the gallery, a hundred feet above the sea.",
    "Once a wave broke the lantern glass, and the keeper held a tarpaulin over the lamp all night.",
    "The harbour master in the town wrote letters asking for a second keeper every spring.",
    "The board replied each year that the budget did not allow it, and the letters piled up.",
    "Visitors rarely came, but a geologist spent one summer mapping the layers of the cliff.",
    "He found fossils of shellfish older than any tree, pressed flat in the grey slate.",
    "The rock itself was basalt, cooled from lava that had flowed when the ocean was young.",
    "Seabirds nested on every ledge, and their noise drowned the horn on calm mornings.",
    "The keeper counted them each May and sent the numbers to a society in the capital.",
    "Radio arrived in the nineteen-twenties and ended the station's long silences.",
    "After automation the tower stood empty, its lamp switched on and off by a timer.",
    "Ships now navigate by satellite, yet the light still turns every night over the water.",
    "A museum in the town keeps the keeper's logbooks, forty years of wind and weather.",
    "Reading them one learns how often the sea was calm, and how rarely anyone noticed.",
    "The daughter later became an engineer and designed breakwaters for three harbours.",
]

QUESTIONS = [
    "What powered the fog horn? Answer in one sentence.",
    "Who kept the station's accounts? Answer in one sentence.",
    "What did the geologist find in the cliff? Answer in one sentence.",
    "What happened to the station after automation? Answer in one sentence.",
]


def passage(tag, n_sentences, offset=0):
    """Numbered sentences, distinct per tag so no run finds another's prefix."""
    out = [f"Document {tag}."]
    for i in range(n_sentences):
        out.append(f"({i + 1}) " + SENTENCES[(i + offset) % len(SENTENCES)])
    return " ".join(out)


# Sizes, calibrated with SmolLM2's tokenizer (about 21 tokens a sentence).
DECODE_SENTENCES = 8       # ~200-token prompt with the system message and question
HISTORY_SENTENCES = 20     # ~440-token user message per history turn
DOC_SENTENCES = 92         # ~2,000-token document

# ---- HTTP -------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(port, method, path, body=None, headers=None, timeout=600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        h = {"content-type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=h)
        r = conn.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data) if data else None
        except ValueError:
            return r.status, data.decode(errors="replace")
    finally:
        conn.close()


def sse(port, path, body, headers=None, timeout=600):
    """Yields (arrival time, data string) for each `data:` line."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        h = {"content-type": "application/json", "accept": "text/event-stream"}
        h.update(headers or {})
        conn.request("POST", path, body=json.dumps(body), headers=h)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
        while True:
            line = r.readline()
            if not line:
                return
            line = line.strip()
            if line.startswith(b"data:"):
                yield time.perf_counter(), line[5:].strip().decode()
    finally:
        conn.close()


# ---- servers ----------------------------------------------------------------


def server_env():
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")
    return env


class Server:
    name = "?"

    def __init__(self, workdir):
        self.workdir = workdir
        self.proc = None
        self.port = None
        self.log = None
        self.starts = 0

    def stop(self):
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.log:
            self.log.close()
            self.log = None

    def spawn(self, argv):
        self.starts += 1
        self.log = open(os.path.join(self.workdir, f"{self.name}-{self.starts}.log"), "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=server_env())

    def check_alive(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                               f"see {self.log.name}")


class Superfluid(Server):
    name = "superfluid"

    def __init__(self, binary, model, workdir, flags=()):
        super().__init__(workdir)
        self.binary, self.model = binary, model
        self.sessions = os.path.join(workdir, "sf-sessions")
        self.token = None
        # More `serve` flags (--park, --park-lossy): --sf-park.
        self.flags = list(flags)

    def park_bytes(self, session):
        """The size of the session's park artifact and its segments
        (`<session>.park.<k>`, incremental seals), or None."""
        d = os.path.join(self.sessions, "park")
        p = os.path.join(d, f"{session}.park")
        if not os.path.exists(p):
            return None
        segments = [f for f in os.listdir(d) if f.startswith(f"{session}.park.")
                    and f.rsplit(".", 1)[1].isdigit()]
        return os.path.getsize(p) + sum(os.path.getsize(os.path.join(d, f)) for f in segments)

    def start(self):
        """Starts (or restarts, on the same log) and returns seconds to ready."""
        self.port = free_port()
        token_path = os.path.join(self.sessions, "web-token")
        old = os.stat(token_path).st_mtime_ns if os.path.exists(token_path) else None
        t0 = time.perf_counter()
        self.spawn([self.binary, "serve", self.model, "--sessions", self.sessions,
                    "--socket", os.path.join(self.workdir, "sf.sock"),
                    "--web", f"127.0.0.1:{self.port}", "--threads", str(THREADS),
                    "--ctx-size", str(CTX), "--parallel", str(PARALLEL)] + self.flags)
        while True:
            self.check_alive()
            try:
                st, _ = http_json(self.port, "GET", "/web/health", timeout=2)
                if st == 200 and os.path.exists(token_path) and \
                        os.stat(token_path).st_mtime_ns != old:
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > 120:
                raise RuntimeError("superfluid did not start")
            time.sleep(0.02)
        with open(token_path) as f:
            self.token = f.read().strip()
        # Ready means a generation can run: the worker has loaded the model.
        s = self.create()
        self.append(s, 1, "Hi.")
        self.generate(s, 1)
        return time.perf_counter() - t0

    def headers(self):
        return {"authorization": f"Bearer {self.token}", "x-superfluid-csrf": self.token}

    def rpc(self, request):
        st, reply = http_json(self.port, "POST", "/web/rpc", request, self.headers())
        if st != 200 or not isinstance(reply, dict) or "Err" in reply:
            raise RuntimeError(f"superfluid {request!r:.200}: {st} {reply!r:.300}")
        return reply

    def create(self):
        return self.rpc({"Create": {"parent": None, "params": GREEDY}})["Created"]["session"]

    def append(self, session, role, text):
        """Returns the committed event's id."""
        r = self.rpc({"AppendMessage": {"session": session, "role": role, "text": text}})
        return r["Committed"]["event"]["event_id"]

    def fork(self, session, at_event):
        r = self.rpc({"Fork": {"session": session, "at_event": at_event, "params": None}})
        return r["Created"]["session"]

    def events(self, session):
        return self.rpc({"Read": {"session": session, "cursor": 0}})["Events"]["events"]

    def last_prompt_len(self, session):
        """Tokens on the input of the session's last turn, its assistant header included."""
        n = last = 0
        for e in self.events(session):
            body = e["body"]
            if isinstance(body, dict):
                kind, data = next(iter(body.items()))
                if kind == "GenerationPrompt":
                    last = n + len(data["span"])
                n += len(data.get("span", []))
        return last

    def generate(self, session, max_tokens, t0=None):
        """Streams one turn. Times are seconds from t0 (default: the request)."""
        t0 = time.perf_counter() if t0 is None else t0
        first = last = done_t = None
        text, done = [], None
        for t, data in sse(self.port, "/web/stream",
                           {"session": session, "max_tokens": max_tokens, "provisional": True},
                           self.headers()):
            if data == "[DONE]":
                break
            d = json.loads(data)
            if "provisional" in d:
                first = first or t
                last = t
                text.append(d["provisional"]["text"])
            elif "committed" in d:
                first = first or t
            elif "done" in d:
                done, done_t = d["done"], t
            elif "error" in d:
                raise RuntimeError(f"superfluid generation failed: {d['error']}")
        if done is None:
            raise RuntimeError("superfluid stream ended without done")
        n = done["tokens_generated"]
        return {
            "ttft_s": first - t0,
            "total_s": done_t - t0,
            "tokens": n,
            "decode_tps": (n - 1) / (done_t - first) if n > 1 and done_t > first else None,
            "warm_prefix": done["warm_prefix"],
            "text": "".join(text),
        }

    def turn(self, session, user_text, max_tokens):
        """Appends a user message and generates; the clock starts at the append."""
        t0 = time.perf_counter()
        self.append(session, 1, user_text)
        r = self.generate(session, max_tokens, t0)
        r["prompt_tokens"] = self.last_prompt_len(session)
        r["computed"] = r["prompt_tokens"] - r["warm_prefix"]
        return r


class LlamaServer(Server):
    name = "llama-server"

    def __init__(self, binary, model, workdir):
        super().__init__(workdir)
        self.binary, self.model = binary, model
        self.slots = os.path.join(workdir, "llama-slots")
        os.makedirs(self.slots, exist_ok=True)

    def argv(self):
        return [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(THREADS), "-tb", str(THREADS), "-c", str(CTX), "-np", str(PARALLEL),
                "-cb", "--slot-save-path", self.slots, "--metrics"]

    def start(self):
        self.port = free_port()
        t0 = time.perf_counter()
        self.spawn(self.argv())
        while True:
            self.check_alive()
            try:
                st, _ = http_json(self.port, "GET", "/health", timeout=2)
                if st == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > 120:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.02)
        self.chat([{"role": "user", "content": "Hi."}], 1, slot=PARALLEL - 1)
        return time.perf_counter() - t0

    def chat(self, messages, max_tokens, slot=None, t0=None):
        t0 = time.perf_counter() if t0 is None else t0
        body = {"messages": messages, "max_tokens": max_tokens, "n_predict": max_tokens,
                "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1,
                "cache_prompt": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if slot is not None:
            body["id_slot"] = slot
        first = last = end = None
        text, timings, usage, n_chunks = [], None, None, 0
        for t, data in sse(self.port, "/v1/chat/completions", body):
            if data == "[DONE]":
                end = t
                break
            d = json.loads(data)
            if "error" in d:
                raise RuntimeError(f"llama-server: {d['error']}")
            for c in d.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first or t
                    last = t
                    n_chunks += 1
                    text.append(piece)
            timings = d.get("timings") or timings
            usage = d.get("usage") or usage
            end = t
        if first is None:
            raise RuntimeError(f"llama-server produced no text: {timings} {usage}")
        n = (timings or {}).get("predicted_n") or (usage or {}).get("completion_tokens") or n_chunks
        prompt_n = (timings or {}).get("prompt_n")
        cache_n = (timings or {}).get("cache_n")
        return {
            "ttft_s": first - t0,
            "total_s": end - t0,
            "tokens": n,
            "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else None,
            "prompt_tokens": (prompt_n or 0) + (cache_n or 0) if timings else
            (usage or {}).get("prompt_tokens"),
            "computed": prompt_n,
            "own_prompt_tps": (timings or {}).get("prompt_per_second"),
            "own_decode_tps": (timings or {}).get("predicted_per_second"),
            "text": "".join(text),
        }

    def slot_action(self, slot, action, filename):
        t0 = time.perf_counter()
        st, r = http_json(self.port, "POST", f"/slots/{slot}?action={action}",
                          {"filename": filename})
        if st != 200:
            raise RuntimeError(f"slot {action}: {st} {r!r:.300}")
        return time.perf_counter() - t0, r


# ---- workloads --------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Run {tag}."


def ab(run):
    """Which server goes first in this run."""
    return ("sf", "ll") if run % 2 == 0 else ("ll", "sf")


def decode_prompt(tag):
    return (passage(tag, DECODE_SENTENCES)
            + "\n\nWrite a short story about the lighthouse keeper and a storm.")


def sf_single(sf, tag, max_tokens):
    s = sf.create()
    sf.append(s, 0, SYSTEM.format(tag=tag))
    return sf.turn(s, decode_prompt(tag), max_tokens)


def ll_single(ll, tag, max_tokens, slot=None):
    return ll.chat([{"role": "system", "content": SYSTEM.format(tag=tag)},
                    {"role": "user", "content": decode_prompt(tag)}], max_tokens, slot)


def w_decode(sf, ll, runs, out):
    for run in range(runs):
        for who in ab(run):
            if who == "sf":
                r = sf_single(sf, f"d{run}", DECODE_TOKENS)
                out["sf"].append(r)
            else:
                r = ll_single(ll, f"d{run}", DECODE_TOKENS)
                out["ll"].append(r)
            log(f"  decode run {run} {who}: prompt {r['prompt_tokens']} tok, ttft {r['ttft_s']:.3f}s, "
                f"{r['tokens']} tok at {r['decode_tps'] or 0:.1f} tok/s")


def at_once(n, work, what):
    """Calls work(0..n) on n threads released together by a barrier; returns
    (their results, seconds from the release to the last one's end)."""
    results = [None] * n
    barrier = threading.Barrier(n + 1)

    def run(k):
        barrier.wait()
        results[k] = work(k)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(r is None for r in results):
        raise RuntimeError(f"{what} failed")
    return results, wall


def concurrent_round(who, server, run, prefix="c"):
    """PARALLEL streams started at once on `server` ("sf" or "ll"), each a
    decode prompt and DECODE_TOKENS; returns (results, seconds from the start
    to the last stream's end)."""
    if who == "sf":
        sessions = []
        for k in range(PARALLEL):
            s = server.create()
            server.append(s, 0, SYSTEM.format(tag=f"{prefix}{run}.{k}"))
            sessions.append(s)

        def work(k):
            return server.turn(sessions[k], decode_prompt(f"{prefix}{run}.{k}"), DECODE_TOKENS)
    else:
        def work(k):
            return ll_single(server, f"{prefix}{run}.{k}", DECODE_TOKENS)
    return at_once(PARALLEL, work, f"{who}: a concurrent stream")


def w_concurrent(sf, ll, runs, out):
    for run in range(runs):
        for who in ab(run):
            results, wall = concurrent_round(who, sf if who == "sf" else ll, run)
            tokens = sum(r["tokens"] for r in results)
            ttft_max = max(r["ttft_s"] for r in results)
            rec = {"wall_s": wall, "tokens": tokens, "agg_tps": tokens / wall,
                   "ttft_max_s": ttft_max,
                   # Generation only: from the last stream's first token to the end.
                   "agg_decode_tps": (tokens - PARALLEL) / (wall - ttft_max)}
            out[who].append(rec)
            log(f"  concurrent run {run} {who}: {tokens} tok in {wall:.2f}s = {rec['agg_tps']:.1f} tok/s")


def history_message(tag, turn):
    return (passage(f"{tag}/{turn}", HISTORY_SENTENCES, offset=turn * 5)
            + f"\n\nIn one sentence, what is the main point of part {turn + 1}?")


TURN_N = "Thank you. Now list the three most important facts from everything above."
TURN_N1 = "One more question: which part mentioned the fog horn?"
TURN_N2 = "And which part mentioned the keeper's log book?"


def w_multiturn(sf, ll, runs, out, convs):
    """Builds a ~2,000-token conversation per run on each server, then times turn N."""
    for run in range(runs):
        tag = f"m{run}"
        for who in ab(run):
            if who == "sf":
                s = sf.create()
                sf.append(s, 0, SYSTEM.format(tag=tag))
                for k in range(HISTORY_TURNS):
                    sf.turn(s, history_message(tag, k), HISTORY_REPLY)
                r = sf.turn(s, TURN_N, TURN_N_REPLY)
                r["history_tokens"] = r["prompt_tokens"] - r["computed"]
                # What its park artifact will hold: the turn's prompt and reply.
                convs.setdefault("sf_tokens", []).append(r["prompt_tokens"] + r["tokens"])
                convs["sf"].append(s)
            else:
                msgs = [{"role": "system", "content": SYSTEM.format(tag=tag)}]
                for k in range(HISTORY_TURNS):
                    msgs.append({"role": "user", "content": history_message(tag, k)})
                    h = ll.chat(msgs, HISTORY_REPLY, slot=0)
                    msgs.append({"role": "assistant", "content": h["text"]})
                msgs.append({"role": "user", "content": TURN_N})
                r = ll.chat(msgs, TURN_N_REPLY, slot=0)
                msgs.append({"role": "assistant", "content": r["text"]})
                r["history_tokens"] = r["prompt_tokens"] - r["computed"]
                # Park the conversation for the restart workload.
                save_s, info = ll.slot_action(0, "save", f"conv-{run}.bin")
                r["slot_save_s"] = save_s
                r["slot_file_bytes"] = os.path.getsize(os.path.join(ll.slots, f"conv-{run}.bin"))
                r["slot_bytes_per_token"] = r["slot_file_bytes"] / (r["prompt_tokens"] + r["tokens"])
                convs["ll"].append(msgs)
            out[who].append(r)
            log(f"  multiturn run {run} {who}: turn N prompt {r['prompt_tokens']} tok, "
                f"computed {r['computed']}, ttft {r['ttft_s']:.3f}s")


def fanout_doc(tag):
    return passage(tag, DOC_SENTENCES) + "\n\nRead the document above; questions follow."


def w_fanout(sf, ll, runs, out):
    for run in range(runs):
        tag = f"f{run}"
        for who in ab(run):
            results = [None] * len(QUESTIONS)
            if who == "sf":
                t0 = time.perf_counter()
                parent = sf.create()
                sf.append(parent, 0, SYSTEM.format(tag=tag))
                doc_event = sf.append(parent, 1, fanout_doc(tag))
                # Prefill the document once (superfluid prefills at generation).
                warm = sf.generate(parent, 1)
                warm_computed = sf.last_prompt_len(parent) - warm["warm_prefix"]
                t_doc = time.perf_counter() - t0
                forks = [sf.fork(parent, doc_event + 1) for _ in QUESTIONS]

                def work(k):
                    results[k] = sf.turn(forks[k], QUESTIONS[k], FANOUT_REPLY)
                threads = [threading.Thread(target=work, args=(k,)) for k in range(len(QUESTIONS))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
                if any(r is None for r in results):
                    raise RuntimeError("superfluid: a fork failed")
                computed = warm_computed + sum(r["computed"] for r in results)
                prompt = sum(r["prompt_tokens"] for r in results)
                rec = {"wall_s": wall, "computed": computed, "prompt_tokens": prompt,
                       "doc_prefill_s": t_doc, "warm_prefix": [r["warm_prefix"] for r in results]}
            else:
                t0 = time.perf_counter()

                def work(k):
                    results[k] = ll.chat([{"role": "system", "content": SYSTEM.format(tag=tag)},
                                          {"role": "user", "content": fanout_doc(tag)},
                                          {"role": "user", "content": QUESTIONS[k]}],
                                         FANOUT_REPLY)
                threads = [threading.Thread(target=work, args=(k,)) for k in range(len(QUESTIONS))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
                if any(r is None for r in results):
                    raise RuntimeError("llama-server: a fanout request failed")
                rec = {"wall_s": wall, "computed": sum(r["computed"] for r in results),
                       "prompt_tokens": sum(r["prompt_tokens"] for r in results)}
            rec["tokens"] = sum(r["tokens"] for r in results)
            out[who].append(rec)
            log(f"  fanout run {run} {who}: {rec['wall_s']:.2f}s, computed {rec['computed']} "
                f"of {rec['prompt_tokens']} prompt tokens")


def w_restart(sf, ll, runs, out, convs):
    """Restarts both servers, then asks turn N+1 of each multiturn conversation."""
    if sf.flags:
        # Every artifact is long written by now; each holds its conversation.
        out["sf_park_bytes_per_token"] = [
            (sf.park_bytes(s) or 0) / n for s, n in zip(convs["sf"], convs.get("sf_tokens", []))]
    sf.stop()
    ll.stop()
    out["sf_start_s"] = sf.start()
    out["ll_start_s"] = ll.start()
    log(f"  restarted: superfluid ready in {out['sf_start_s']:.2f}s, "
        f"llama-server in {out['ll_start_s']:.2f}s")
    for run in range(min(runs, len(convs["sf"]), len(convs["ll"]))):
        for who in ab(run):
            if who == "sf":
                r = sf.turn(convs["sf"][run], TURN_N1, TURN_N_REPLY)
                out["sf"].append(r)
                log(f"  restart run {run} sf: ttft {r['ttft_s']:.3f}s, computed {r['computed']} "
                    f"of {r['prompt_tokens']}")
            else:
                msgs = convs["ll"][run] + [{"role": "user", "content": TURN_N1}]
                # Without the saved slot: a cold prefill, on a slot not used here.
                cold = ll.chat(msgs, TURN_N_REPLY, slot=1 + run % (PARALLEL - 1))
                t0 = time.perf_counter()
                restore_s, info = ll.slot_action(0, "restore", f"conv-{run}.bin")
                r = ll.chat(msgs, TURN_N_REPLY, slot=0, t0=t0)
                r["restore_s"] = restore_s
                r["restored_tokens"] = (info or {}).get("n_restored") if isinstance(info, dict) else None
                r["cold_ttft_s"] = cold["ttft_s"]
                r["cold_computed"] = cold["computed"]
                out["ll"].append(r)
                log(f"  restart run {run} ll: restore {restore_s * 1000:.0f}ms + ttft "
                    f"{r['ttft_s']:.3f}s (computed {r['computed']} of {r['prompt_tokens']}); "
                    f"cold {cold['ttft_s']:.3f}s")
    if sf.flags:
        # The same without the park tier: restarted without it, the next
        # turn prefills the whole history.
        flags, sf.flags = sf.flags, []
        sf.stop()
        sf.start()
        out["sf_cold"] = []
        for run in range(min(runs, len(convs["sf"]))):
            r = sf.turn(convs["sf"][run], TURN_N2, TURN_N_REPLY)
            out["sf_cold"].append(r)
            log(f"  restart without {' '.join(flags)} run {run} sf: ttft {r['ttft_s']:.3f}s, "
                f"computed {r['computed']} of {r['prompt_tokens']}")
        sf.flags = flags


IDLE_SESSIONS = 3
IDLE_PAUSE_S = 2.5   # idle: untouched this long (superfluid's --idle-spill-ms default is 2 s)


def w_idle(sf, ll, runs, out):
    """One stream alone, then beside IDLE_SESSIONS idle conversations (one ~440-token turn each,
    then untouched for IDLE_PAUSE_S), on a fresh start of each server: decode speed beside /
    alone. Then turn 2 of the first idle conversation against turn 2 of the last, asked at once
    after its turn 1 (resident): time to first token."""
    for run in range(runs):
        for who in ab(run):
            srv = sf if who == "sf" else ll
            srv.stop()
            srv.start()
            tags = [f"i{run}.{k}" for k in range(IDLE_SESSIONS)]
            if who == "sf":
                alone = sf_single(sf, f"ia{run}", DECODE_TOKENS)
                sessions = []
                for tag in tags:
                    s = sf.create()
                    sf.append(s, 0, SYSTEM.format(tag=tag))
                    sf.turn(s, history_message(tag, 0), HISTORY_REPLY)
                    sessions.append(s)
                resident = sf.turn(sessions[-1], TURN_N, TURN_N_REPLY)
                time.sleep(IDLE_PAUSE_S)
                beside = sf_single(sf, f"ib{run}", DECODE_TOKENS)
                idle = sf.turn(sessions[0], TURN_N, TURN_N_REPLY)
            else:
                alone = ll_single(ll, f"ia{run}", DECODE_TOKENS, slot=0)
                convs = []
                for k, tag in enumerate(tags):
                    msgs = [{"role": "system", "content": SYSTEM.format(tag=tag)},
                            {"role": "user", "content": history_message(tag, 0)}]
                    r = ll.chat(msgs, HISTORY_REPLY, slot=k + 1)
                    msgs.append({"role": "assistant", "content": r["text"]})
                    msgs.append({"role": "user", "content": TURN_N})
                    convs.append(msgs)
                resident = ll.chat(convs[-1], TURN_N_REPLY, slot=IDLE_SESSIONS)
                time.sleep(IDLE_PAUSE_S)
                beside = ll_single(ll, f"ib{run}", DECODE_TOKENS, slot=0)
                idle = ll.chat(convs[0], TURN_N_REPLY, slot=1)
            rec = {"alone_tps": alone["decode_tps"], "beside_tps": beside["decode_tps"],
                   "ratio": beside["decode_tps"] / alone["decode_tps"],
                   "resident_ttft_s": resident["ttft_s"], "idle_ttft_s": idle["ttft_s"],
                   "idle_computed": idle["computed"], "resident_computed": resident["computed"]}
            out[who].append(rec)
            log(f"  idle run {run} {who}: alone {rec['alone_tps']:.1f} tok/s, beside "
                f"{IDLE_SESSIONS} idle {rec['beside_tps']:.1f} tok/s ({rec['ratio']:.3f}x); turn 2 "
                f"ttft idle {rec['idle_ttft_s']:.3f}s (computed {rec['idle_computed']}), resident "
                f"{rec['resident_ttft_s']:.3f}s (computed {rec['resident_computed']})")


# ---- the OpenAI route, both servers alike ------------------------------------

OAI_PATH = "/v1/chat/completions"


def oai_headers(server):
    """superfluid's compatible routes take its web token (or --api-key) as a bearer."""
    return {"authorization": f"Bearer {server.token}"} if isinstance(server, Superfluid) else {}


def oai_body(server, messages, max_tokens):
    """The same body for both; llama-server's also says cache_prompt (its default)."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "top_p": 1.0, "seed": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    if isinstance(server, LlamaServer):
        body["cache_prompt"] = True
    return body


def oai_chat(server, messages, max_tokens, t0=None):
    """One streamed chat completion. Times are seconds from t0 (default: the request)."""
    t0 = time.perf_counter() if t0 is None else t0
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    h = {"content-type": "application/json", "accept": "text/event-stream"}
    h.update(oai_headers(server))
    first = last = end = None
    text, usage, timings, n_chunks, warm_header = [], None, None, 0, None
    try:
        conn.request("POST", OAI_PATH, body=json.dumps(oai_body(server, messages, max_tokens)),
                     headers=h)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{server.name} {OAI_PATH}: HTTP {r.status}: {r.read()[:300]!r}")
        warm_header = r.getheader("x-superfluid-warm")
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            t, data = time.perf_counter(), line[5:].strip().decode()
            if data == "[DONE]":
                end = t
                break
            d = json.loads(data)
            if "error" in d:
                raise RuntimeError(f"{server.name}: {d['error']}")
            for c in d.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first or t
                    last = t
                    n_chunks += 1
                    text.append(piece)
            usage = d.get("usage") or usage
            timings = d.get("timings") or timings
    finally:
        conn.close()
    if end is None:
        raise RuntimeError(f"{server.name}: the stream ended without [DONE]")
    if first is None:
        raise RuntimeError(f"{server.name} produced no text: {usage}")
    if not usage:
        raise RuntimeError(f"{server.name}: no usage chunk despite include_usage")
    n = usage.get("completion_tokens") or n_chunks
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "ttft_s": first - t0,
        "total_s": end - t0,
        "tokens": n,
        "chunks": n_chunks,
        "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else None,
        "prompt_tokens": prompt,
        "cached": cached,
        "computed": prompt - cached if prompt is not None else None,
        "warm_header": int(warm_header) if warm_header is not None else None,
        "own_prompt_n": (timings or {}).get("prompt_n"),
        "own_cache_n": (timings or {}).get("cache_n"),
        "text": "".join(text),
    }


PREFILL_COUNTER = {"sf": "superfluid_prefill_tokens_total", "ll": "llamacpp:prompt_tokens_total"}


def prompt_counter(server, who):
    """The server's own count of prompt tokens computed, from GET /metrics; None if not served."""
    st, text = http_json(server.port, "GET", "/metrics", headers=oai_headers(server))
    if st != 200 or not isinstance(text, str):
        return None
    name = PREFILL_COUNTER[who]
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) >= 2 and (parts[0] == name or parts[0].startswith(name + "{")):
            total += float(parts[1])
            seen = True
    return int(total) if seen else None


def oai_single_messages(tag):
    return [{"role": "system", "content": SYSTEM.format(tag=tag)},
            {"role": "user", "content": decode_prompt(tag)}]


def w_oai_decode(sf, ll, runs, out):
    servers = {"sf": sf, "ll": ll}
    for run in range(runs):
        for who in ab(run):
            r = oai_chat(servers[who], oai_single_messages(f"od{run}"), DECODE_TOKENS)
            out[who].append(r)
            log(f"  oai-decode run {run} {who}: prompt {r['prompt_tokens']} tok, "
                f"ttft {r['ttft_s']:.3f}s, {r['tokens']} tok at {r['decode_tps'] or 0:.1f} tok/s")


def w_oai_multiturn(sf, ll, runs, out):
    """Each server answers its own ~2,000-token chat, resent whole each turn, as a
    client of the OpenAI API does; turn N is timed."""
    servers = {"sf": sf, "ll": ll}
    for run in range(runs):
        tag = f"om{run}"
        for who in ab(run):
            srv = servers[who]
            msgs = [{"role": "system", "content": SYSTEM.format(tag=tag)}]
            history = []
            for k in range(HISTORY_TURNS):
                msgs.append({"role": "user", "content": history_message(tag, k)})
                h = oai_chat(srv, msgs, HISTORY_REPLY)
                history.append({"ttft_s": h["ttft_s"], "prompt_tokens": h["prompt_tokens"],
                                "computed": h["computed"]})
                msgs.append({"role": "assistant", "content": h["text"]})
            msgs.append({"role": "user", "content": TURN_N})
            r = oai_chat(srv, msgs, TURN_N_REPLY)
            r["history_tokens"] = r["cached"]
            r["history_turns"] = history
            out[who].append(r)
            log(f"  oai-multiturn run {run} {who}: turn N prompt {r['prompt_tokens']} tok, "
                f"cached {r['cached']}, computed {r['computed']}, ttft {r['ttft_s']:.3f}s")


def w_oai_fanout(sf, ll, runs, out):
    """Four requests with the same system+document prefix and different final
    questions, sent together, nothing prefilled before."""
    servers = {"sf": sf, "ll": ll}
    for run in range(runs):
        tag = f"of{run}"
        for who in ab(run):
            srv = servers[who]
            before = prompt_counter(srv, who)

            def work(k, srv=srv, tag=tag):
                return oai_chat(srv, [{"role": "system", "content": SYSTEM.format(tag=tag)},
                                      {"role": "user", "content": fanout_doc(tag)},
                                      {"role": "user", "content": QUESTIONS[k]}],
                                FANOUT_REPLY)
            results, wall = at_once(len(QUESTIONS), work, f"{who}: an oai-fanout request")
            after = prompt_counter(srv, who)
            by_usage = sum(r["computed"] for r in results)
            metric = after - before if before is not None and after is not None else None
            rec = {"wall_s": wall,
                   "computed": metric if metric is not None else by_usage,
                   "computed_source": f"/metrics {PREFILL_COUNTER[who]} delta" if metric is not None
                   else "usage: sum of prompt_tokens - cached_tokens",
                   "computed_metrics": metric, "computed_usage": by_usage,
                   "prompt_tokens": sum(r["prompt_tokens"] for r in results),
                   "cached": [r["cached"] for r in results],
                   "ttft_s": [r["ttft_s"] for r in results],
                   "ttft_max_s": max(r["ttft_s"] for r in results),
                   "tokens": sum(r["tokens"] for r in results)}
            out[who].append(rec)
            log(f"  oai-fanout run {run} {who}: {wall:.2f}s, computed {rec['computed']} "
                f"({rec['computed_source']}; usage says {by_usage}) of {rec['prompt_tokens']} "
                f"prompt tokens, cached {rec['cached']}")


# ---- report -----------------------------------------------------------------


def tree_rss_bytes(pid):
    """Resident memory of `pid` and all its descendants (superfluid: the
    daemon and its worker), from /proc."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def stats(values):
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v),
            "ints": all(isinstance(x, int) for x in v)}


def fmt(st, unit, prec=None):
    if st is None:
        return "n/a"
    if prec is None and st.get("ints"):
        prec = 0
    if prec is None:
        prec = 0 if st["median"] >= 100 else (1 if st["median"] >= 10 else (2 if st["median"] >= 1 else 3))
    f = f"{{:.{prec}f}}"
    return f"{f.format(st['median'])}{unit} ({f.format(st['min'])}-{f.format(st['max'])})"


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine():
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // 1024
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_mib": mem, "kernel": platform.release(),
            "python": platform.python_version()}


def version_of(argv):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return (p.stdout + p.stderr).strip().splitlines()[-2:] if (p.stdout + p.stderr).strip() else None
    except Exception as e:  # noqa: BLE001
        return str(e)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--superfluid", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default=os.environ.get("SUPERFLUID_TEST_MODEL", DEFAULT_MODEL))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 runs each, a smoke test")
    ap.add_argument("--only", default="decode,concurrent,multiturn,fanout,restart,idle,"
                    "oai-decode,oai-multiturn,oai-fanout")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/peer-<date>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--sf-park", choices=["off", "park", "lossy"], default="off",
                    help="superfluid's park tier (--park, --park-lossy); the restart workload "
                         "then restarts once more without it")
    args = ap.parse_args()
    runs = 2 if args.quick else args.runs
    only = set(args.only.split(","))
    if "restart" in only:
        only.add("multiturn")

    workdir = tempfile.mkdtemp(prefix="superfluid-peer-")
    # Private copies: others may rebuild the binaries while this runs.
    sf_bin = os.path.join(workdir, "superfluid")
    shutil.copy2(args.superfluid, sf_bin)
    sf = Superfluid(sf_bin, args.model, workdir,
                    {"off": [], "park": ["--park"], "lossy": ["--park-lossy"]}[args.sf_park])
    ll = LlamaServer(os.path.abspath(args.llama_server), args.model, workdir)

    started = datetime.datetime.now()
    out_path = args.out or os.path.join(REPO, "bench", "results",
                                        f"peer-{started.strftime('%Y-%m-%d')}.json")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    git = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    report = {
        "date": started.isoformat(timespec="seconds"),
        "machine": machine(),
        "superfluid": {"git": git + ("+dirty" if dirty else ""), "binary": args.superfluid},
        "llama_server": {"binary": args.llama_server,
                         "version": version_of([args.llama_server, "--version"])},
        "model": args.model,
        "config": {"threads": THREADS, "ctx": CTX, "parallel": PARALLEL, "runs": runs,
                   "decode_tokens": DECODE_TOKENS, "history_turns": HISTORY_TURNS,
                   "history_reply": HISTORY_REPLY, "fanout_reply": FANOUT_REPLY,
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                   "llama_server_argv": None, "superfluid_flags":
                       f"--threads {THREADS} --ctx-size {CTX} --parallel {PARALLEL} "
                       + " ".join(sf.flags)},
        "loadavg": {"start": loadavg()},
        "workloads": {},
    }
    W = report["workloads"]
    try:
        report["startup_s"] = {"superfluid": sf.start(), "llama_server": ll.start()}
        report["config"]["llama_server_argv"] = " ".join(ll.argv()[1:])
        log(f"both up (superfluid {report['startup_s']['superfluid']:.2f}s, "
            f"llama-server {report['startup_s']['llama_server']:.2f}s); workdir {workdir}")
        # One discarded request each, so neither pays a first-use cost in a timed run.
        sf_single(sf, "warmup", 16)
        ll_single(ll, "warmup", 16)
        # Memory after load (and one short request): the daemon and its
        # worker against llama-server.
        W["memory"] = {"sf": [{"rss_bytes": tree_rss_bytes(sf.proc.pid)}],
                       "ll": [{"rss_bytes": tree_rss_bytes(ll.proc.pid)}]}
        if any(n.startswith("oai-") for n in only):
            oai_chat(sf, oai_single_messages("oai-warmup"), 16)
            oai_chat(ll, oai_single_messages("oai-warmup"), 16)
        convs = {"sf": [], "ll": []}
        for name, fn in [("decode", w_decode), ("concurrent", w_concurrent),
                         ("multiturn", w_multiturn), ("fanout", w_fanout), ("restart", w_restart),
                         ("idle", w_idle),
                         ("oai-decode", w_oai_decode), ("oai-fanout", w_oai_fanout),
                         ("oai-multiturn", w_oai_multiturn)]:
            if name not in only:
                continue
            out = {"sf": [], "ll": [], "loadavg_before": loadavg()}
            log(f"{name} (load average {out['loadavg_before'][0]:.2f})")
            t = time.perf_counter()
            if name in ("multiturn", "restart"):
                fn(sf, ll, runs, out, convs)
            else:
                fn(sf, ll, runs, out)
            out["seconds"] = time.perf_counter() - t
            for r in out["sf"] + out["ll"]:
                r.pop("text", None)
            # Saved as it goes, so an interrupted run keeps what it measured.
            W[name] = out
            save_partial(report, out_path)
        if sf.proc and ll.proc:
            W["memory"]["sf_end"] = tree_rss_bytes(sf.proc.pid)
            W["memory"]["ll_end"] = tree_rss_bytes(ll.proc.pid)
    finally:
        sf.stop()
        ll.stop()
        report["loadavg"]["end"] = loadavg()

    rows = table_rows(W)
    report["table"] = rows
    md = render(report, rows)
    print(md)
    report.pop("partial", None)
    report["markdown"] = md
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    log(f"wrote {out_path}")
    if args.keep:
        log(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def save_partial(report, out_path):
    """Writes what has been measured so far (marked partial); main overwrites it at the end."""
    report["partial"] = True
    report["table"] = table_rows(report["workloads"])
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def table_rows(W):
    """(workload, metric, better, superfluid stats, llama-server stats, unit)."""
    rows = []

    def add(workload, metric, better, sf_vals, ll_vals, unit, goal=None):
        """goal: (op, x), the ratio superfluid / llama-server wanted, e.g. ("<=", 1.0)."""
        row = {"workload": workload, "metric": metric, "better": better,
               "superfluid": stats(sf_vals), "llama_server": stats(ll_vals), "unit": unit}
        if goal is not None:
            op, x = goal
            s, l = row["superfluid"], row["llama_server"]
            ratio = s["median"] / l["median"] if s and l and l["median"] else None
            row["goal"] = {"ratio": f"{op} {x}", "met": None if ratio is None else
                           (ratio <= x if op == "<=" else ratio >= x)}
        rows.append(row)

    if "memory" in W:
        m = W["memory"]
        add("memory", "RSS after load, MiB (superfluid: daemon + worker)", "lower",
            [r["rss_bytes"] / 2**20 for r in m["sf"]], [r["rss_bytes"] / 2**20 for r in m["ll"]],
            "", goal=("<=", 1.1))
        if m.get("sf_end") and m.get("ll_end"):
            add("memory", "RSS at the end of the run, MiB", "lower", [m["sf_end"] / 2**20],
                [m["ll_end"] / 2**20], "")
    if "decode" in W:
        d = W["decode"]
        add("decode, 1 stream", "prompt tokens", "-", [r["prompt_tokens"] for r in d["sf"]],
            [r["prompt_tokens"] for r in d["ll"]], "")
        add("decode, 1 stream", "prompt tok/s, client wall (prompt / TTFT)", "higher",
            [r["prompt_tokens"] / r["ttft_s"] for r in d["sf"]],
            [r["prompt_tokens"] / r["ttft_s"] for r in d["ll"]], "", goal=(">=", 1.0))
        add("decode, 1 stream", "time to first token", "lower", [r["ttft_s"] for r in d["sf"]],
            [r["ttft_s"] for r in d["ll"]], " s")
        add("decode, 1 stream", "generated tok/s, client wall ((n-1) / first token to end of stream)", "higher",
            [r["decode_tps"] for r in d["sf"]], [r["decode_tps"] for r in d["ll"]], "",
            goal=(">=", 1.0))
        add("decode, 1 stream", "generated tokens", "-", [r["tokens"] for r in d["sf"]],
            [r["tokens"] for r in d["ll"]], "")
        add("decode, 1 stream", "llama-server's own timings: prompt tok/s", "-", [],
            [r["own_prompt_tps"] for r in d["ll"]], "")
        add("decode, 1 stream", "llama-server's own timings: generated tok/s", "-", [],
            [r["own_decode_tps"] for r in d["ll"]], "")
    if "concurrent" in W:
        c = W["concurrent"]
        add("4 concurrent streams", "aggregate generated tok/s (wall, 4 prefills included)", "higher",
            [r["agg_tps"] for r in c["sf"]], [r["agg_tps"] for r in c["ll"]], "",
            goal=(">=", 1.0))
        add("4 concurrent streams", "aggregate tok/s once all 4 are generating", "higher",
            [r["agg_decode_tps"] for r in c["sf"]], [r["agg_decode_tps"] for r in c["ll"]], "",
            goal=(">=", 1.0))
        add("4 concurrent streams", "slowest first token", "lower",
            [r["ttft_max_s"] for r in c["sf"]], [r["ttft_max_s"] for r in c["ll"]], " s",
            goal=("<=", 1.0))
    if "multiturn" in W:
        m = W["multiturn"]
        add("multi-turn, turn N", "history reused (tokens)", "-",
            [r["history_tokens"] for r in m["sf"]], [r["history_tokens"] for r in m["ll"]], "")
        add("multi-turn, turn N", "prompt tokens computed", "lower",
            [r["computed"] for r in m["sf"]], [r["computed"] for r in m["ll"]], "")
        add("multi-turn, turn N", "time to first token", "lower",
            [r["ttft_s"] for r in m["sf"]], [r["ttft_s"] for r in m["ll"]], " s",
            goal=("<=", 1.0))

    if "fanout" in W:
        f = W["fanout"]
        add("fanout, doc + 4 questions", "total wall time", "lower",
            [r["wall_s"] for r in f["sf"]], [r["wall_s"] for r in f["ll"]], " s")
        add("fanout, doc + 4 questions", "prompt tokens computed", "lower",
            [r["computed"] for r in f["sf"]], [r["computed"] for r in f["ll"]], "")
        add("fanout, doc + 4 questions", "prompt tokens (sum of the 4 prompts)", "-",
            [r["prompt_tokens"] for r in f["sf"]], [r["prompt_tokens"] for r in f["ll"]], "")
    if "restart" in W:
        r = W["restart"]
        add("restart, turn N+1", "server start to ready", "lower",
            [r.get("sf_start_s")], [r.get("ll_start_s")], " s")
        add("restart, turn N+1", "time to first token (llama-server: slot restore + request)",
            "lower", [x["ttft_s"] for x in r["sf"]], [x["ttft_s"] for x in r["ll"]], " s",
            # The goal is with superfluid's park tier on (--sf-park).
            goal=("<=", 1.2) if r.get("sf_park_bytes_per_token") else None)
        add("restart, turn N+1", "prompt tokens computed", "lower",
            [x["computed"] for x in r["sf"]], [x["computed"] for x in r["ll"]], "")
        add("restart, turn N+1", "llama-server without slot restore: time to first token", "-",
            [], [x["cold_ttft_s"] for x in r["ll"]], " s")
        add("restart, turn N+1", "llama-server slot restore alone", "-",
            [], [x["restore_s"] for x in r["ll"]], " s")
        if r.get("sf_park_bytes_per_token") and "multiturn" in W:
            add("restart, turn N+1", "bytes a token: park artifact (llama-server: slot file)",
                "lower", r["sf_park_bytes_per_token"],
                [x["slot_bytes_per_token"] for x in W["multiturn"]["ll"]], "")
        if r.get("sf_cold"):
            add("restart, turn N+2", "superfluid restarted without the park tier: time to first "
                "token (llama-server: without slot restore)", "lower",
                [x["ttft_s"] for x in r["sf_cold"]], [x["cold_ttft_s"] for x in r["ll"]], " s")
            add("restart, turn N+2", "superfluid without the park tier: prompt tokens computed",
                "-", [x["computed"] for x in r["sf_cold"]], [x["cold_computed"] for x in r["ll"]], "")
    if "idle" in W:
        i = W["idle"]
        add(f"one stream beside {IDLE_SESSIONS} idle conversations", "decode speed, beside / alone",
            "higher", [x["ratio"] for x in i["sf"]], [x["ratio"] for x in i["ll"]], "x")
        add(f"one stream beside {IDLE_SESSIONS} idle conversations",
            "turn 2 time to first token, idle / resident", "lower",
            [x["idle_ttft_s"] / x["resident_ttft_s"] for x in i["sf"]],
            [x["idle_ttft_s"] / x["resident_ttft_s"] for x in i["ll"]], "x")
    if "oai-decode" in W:
        d = W["oai-decode"]
        w = "oai-decode, /v1/chat/completions"
        add(w, "prompt tokens (usage)", "-", [r["prompt_tokens"] for r in d["sf"]],
            [r["prompt_tokens"] for r in d["ll"]], "")
        add(w, "time to first token", "lower", [r["ttft_s"] for r in d["sf"]],
            [r["ttft_s"] for r in d["ll"]], " s")
        add(w, "generated tok/s, client wall ((n-1) / first token to [DONE])", "higher",
            [r["decode_tps"] for r in d["sf"]], [r["decode_tps"] for r in d["ll"]], "",
            goal=(">=", 0.97))
        add(w, "generated tokens (usage)", "-", [r["tokens"] for r in d["sf"]],
            [r["tokens"] for r in d["ll"]], "")
    if "oai-multiturn" in W:
        m = W["oai-multiturn"]
        w = "oai-multiturn, turn N, /v1/chat/completions"
        add(w, "prompt tokens (usage)", "-", [r["prompt_tokens"] for r in m["sf"]],
            [r["prompt_tokens"] for r in m["ll"]], "")
        add(w, "history reused (usage cached_tokens)", "-", [r["cached"] for r in m["sf"]],
            [r["cached"] for r in m["ll"]], "")
        add(w, "prompt tokens computed (prompt - cached)", "lower",
            [r["computed"] for r in m["sf"]], [r["computed"] for r in m["ll"]], "")
        add(w, "time to first token", "lower", [r["ttft_s"] for r in m["sf"]],
            [r["ttft_s"] for r in m["ll"]], " s", goal=("<=", 1.0))
    if "oai-fanout" in W:
        f = W["oai-fanout"]
        w = "oai-fanout, doc + 4 questions at once, /v1/chat/completions"
        src = {r.get("computed_source") for r in f["sf"] + f["ll"]}
        how = ("/metrics deltas: superfluid_prefill_tokens_total, llamacpp:prompt_tokens_total"
               if all(x and x.startswith("/metrics") for x in src)
               else "sources: " + "; ".join(sorted(x for x in src if x)))
        add(w, f"prompt tokens computed ({how})", "lower",
            [r["computed"] for r in f["sf"]], [r["computed"] for r in f["ll"]], "",
            goal=("<=", 0.35))
        add(w, "prompt tokens computed, by usage (sum of prompt_tokens - cached_tokens)", "-",
            [r["computed_usage"] for r in f["sf"]], [r["computed_usage"] for r in f["ll"]], "")
        add(w, "prompt tokens (sum of the 4 prompts)", "-",
            [r["prompt_tokens"] for r in f["sf"]], [r["prompt_tokens"] for r in f["ll"]], "")
        add(w, "wall time until all 4 finish", "lower",
            [r["wall_s"] for r in f["sf"]], [r["wall_s"] for r in f["ll"]], " s",
            goal=("<=", 0.5))
        add(w, "slowest first token", "lower",
            [r["ttft_max_s"] for r in f["sf"]], [r["ttft_max_s"] for r in f["ll"]], " s")
    return rows


def render(report, rows):
    cfg = report["config"]
    la = report["loadavg"]
    lines = [
        f"superfluid {report['superfluid']['git']} vs llama-server "
        f"({' '.join(report['llama_server']['version'] or ['?'])}), "
        f"{os.path.basename(report['model'])}, {cfg['threads']} threads, ctx {cfg['ctx']}, "
        f"{cfg['parallel']} parallel, {cfg['runs']} runs each (A/B alternated), "
        f"{report['date']}, {report['machine']['cpu']} x{report['machine']['cores']}, "
        f"load average {la['start'][0]:.2f} at start, {la['end'][0]:.2f} at end.",
        "",
        "Medians (min-max). Ratio = superfluid / llama-server; for times lower is better, "
        "for tok/s higher is better.",
        "",
        "| workload | metric | superfluid | llama-server | ratio | goal |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        s, l = r["superfluid"], r["llama_server"]
        ratio = f"{s['median'] / l['median']:.2f}" if s and l and l["median"] else ""
        g = r.get("goal")
        goal = "" if not g else (f"{g['ratio']}: " + {True: "met", False: "not met",
                                                       None: "n/a"}[g["met"]])
        lines.append(f"| {r['workload']} | {r['metric']} | {fmt(s, r['unit'])} | "
                     f"{fmt(l, r['unit'])} | {ratio} | {goal} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
