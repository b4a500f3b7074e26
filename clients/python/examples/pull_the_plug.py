#!/usr/bin/env python3
"""Pull the plug: SIGKILL the daemon in the middle of a reply, restart it, and
continue the same reply; greedy, it comes out as an uninterrupted run does.

Starts its own daemons (nothing else is touched):

    python3 pull_the_plug.py [--bin PATH] [--model PATH] [--max-tokens N]

The binary is --bin, else SUPERFLUID_BIN, else $CARGO_TARGET_DIR/debug/superfluid,
else ~/.cache/superfluid/target/debug/superfluid; the model is --model, else
SUPERFLUID_TEST_MODEL, else ~/.cache/superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf.

The session is greedy (temperature 0). After the kill, the daemon replays its
log; generating again on the session continues the open assistant turn from
its last committed event. The history is prefilled again, which the spec allows
to differ from the original decode in the last bits of floating point, so the
end of the reply may differ from the uninterrupted run's; the tokens before the
cut never do. Exit status 0 when the reply was continued: the tokens committed
before the kill kept, and the rest drawn after them (not a new reply).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from superfluid_client import Sampling, Session  # noqa: E402
from superfluid_client.daemon import Daemon, default_model, find_binary  # noqa: E402

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
GREEDY = Sampling(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, seed=7)


def turn(session: Session):
    """The tokens and text of the session's last assistant turn, from its log."""
    tokens, text, finish = [], "", None
    for e in session.events():
        if e.kind == "GenerationPrompt":
            tokens, text = [], ""
        elif e.kind == "Generated":
            tokens += e.data["span"]
            if e.data["channel"] == 0:
                text += e.data["text"]
            finish = e.data["finish"]
    return tokens, text, finish


def interrupted(binary: str, model: str, max_tokens: int):
    """Starts a reply, SIGKILLs the daemon mid-reply, restarts, continues it."""
    with Daemon(binary, model) as d:
        s = d.client().session(GREEDY)
        s.user(PROMPT)
        stream = s.stream(max_tokens)
        seen, commits = "", 0
        for chunk in stream:
            seen += chunk.text
            commits = len(stream.committed)
            # In the middle of the reply: a commit made, more text after it.
            if commits >= 1 and len(seen) > len("".join(e.data.get("text", "") for e in stream.committed)) + 8:
                break
        d.kill9()
        stream.close()
        print("killed the daemon (SIGKILL) after {} committed events; shown so far: {!r}".format(commits, seen))
        d.start()
        again = d.client().get(s.id)        # the same session, after the restart
        before, _, _ = turn(again)
        print("restarted; the log holds {} tokens of the reply".format(len(before)))
        reply = again.generate(max_tokens - len(before))    # continues the open turn
        tokens, text, finish = turn(again)
        print("continued: {} more tokens, finish {}".format(reply.tokens, reply.finish))
        return tokens, text, finish, len(before)


def uninterrupted(binary: str, model: str, max_tokens: int):
    """The same greedy reply on a fresh daemon, in one go."""
    with Daemon(binary, model) as d:
        s = d.client().session(GREEDY)
        s.user(PROMPT)
        s.generate(max_tokens)
        return turn(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=None, help="the superfluid binary")
    ap.add_argument("--model", default=None, help="the GGUF model")
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()
    binary = a.bin or find_binary()
    model = a.model or default_model()
    t0 = time.time()
    cut_tokens, cut_text, cut_finish, kept = interrupted(binary, model, a.max_tokens)
    ref_tokens, ref_text, ref_finish = uninterrupted(binary, model, a.max_tokens)
    print("\n--- killed and continued ({} tokens, finish {}):\n{}".format(len(cut_tokens), cut_finish, cut_text))
    print("\n--- uninterrupted ({} tokens, finish {}):\n{}".format(len(ref_tokens), ref_finish, ref_text))
    took = time.time() - t0
    if cut_tokens == ref_tokens and cut_text == ref_text:
        print("\nidentical ({:.1f}s)".format(took))
        return 0
    agree = next((i for i, (a, b) in enumerate(zip(cut_tokens, ref_tokens)) if a != b),
                 min(len(cut_tokens), len(ref_tokens)))
    rest = cut_tokens[kept:]
    if agree >= kept and rest and rest[:8] != ref_tokens[:8]:
        print("\ncontinued; it differs from the uninterrupted run from token {} on, after the "
              "{} kept (the re-prefilled history's last bits, which the spec allows) ({:.1f}s)"
              .format(agree, kept, took))
        return 0
    print("\nNOT CONTINUED: the two runs agree on {} tokens, the log kept {} ({:.1f}s)"
          .format(agree, kept, took))
    return 1


if __name__ == "__main__":
    sys.exit(main())
