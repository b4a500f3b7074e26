"""Both examples, run as subprocesses: fanout.py against the module's daemon,
pull_the_plug.py on daemons of its own."""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")


def run_example(name, *args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name)] + list(args),
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})),
    )


def test_fanout_streams_questions_from_warm_forks(daemon):
    r = run_example("fanout.py", "--max-tokens", "32",
                    env={"SUPERFLUID_URL": daemon.url, "SUPERFLUID_SESSIONS": daemon.sessions})
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    tokens = int(re.search(r"document: (\d+) tokens", r.stdout).group(1))
    assert tokens > 1500, "the built-in document is about 2,000 tokens"
    warm = [int(w) for w in re.findall(r"warm_prefix (\d+)", r.stdout)]
    assert len(warm) == 4 and all(w > 1500 for w in warm), "every fork started warm: {}".format(warm)
    assert len(re.findall(r"^A: ", r.stdout, re.M)) == 4


def test_fanout_reads_a_document_file(daemon, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The secret word is marmalade. The meeting is on Tuesday at noon in room 4.")
    r = run_example("fanout.py", str(doc), "--url", daemon.url, "--token", daemon.token(),
                    "--question", "What is the secret word?", "--question", "Which room?", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert len(re.findall(r"warm_prefix (\d+)", r.stdout)) == 2


def test_pull_the_plug_continues_the_same_reply():
    r = run_example("pull_the_plug.py")
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "killed the daemon (SIGKILL)" in r.stdout
    # Greedy: identical to an uninterrupted run, or (the spec allows a
    # re-prefilled history to differ in the last bits) the same up to the cut
    # and continued from there.
    last = r.stdout.rstrip().splitlines()[-1]
    assert last.startswith("identical") or last.startswith("continued"), last
