"""A previous_response_id chain across a SIGKILL and restart of a daemon
with --park: the step after the restart starts warm from the parked KV of
the response it continues (a fork of that response's session restores the
artifact), instead of prefilling the whole history again."""

import os
import time

from compat import KEY, oai

EXTRA_ARGS = ["--api-key", KEY, "--park"]


def test_a_chain_continued_after_a_restart_starts_warm(daemon):
    c = oai(daemon)
    r1 = c.responses.create(model="default", instructions="You are terse.", input="Name a river.",
                            max_output_tokens=12, temperature=0)
    r2 = c.responses.create(model="default", previous_response_id=r1.id, input="Another one.",
                            max_output_tokens=12, temperature=0)
    assert r2.usage.input_tokens_details.cached_tokens > 0
    # The worker seals r2's session on a thread of its own after answering:
    # wait for the artifact (written to a temp file, then renamed) before the
    # kill, or the restart would find only r1's.
    session = r2.id.split("_")[1]
    artifact = os.path.join(daemon.sessions, "park", session + ".park")
    deadline = time.monotonic() + 60
    while not os.path.exists(artifact):
        assert time.monotonic() < deadline, "r2's session was never parked"
        time.sleep(0.05)
    daemon.restart()  # SIGKILL, then start on the same dir: the KV cells are gone
    c = oai(daemon)
    r3 = c.responses.create(model="default", previous_response_id=r2.id, input="And a third.",
                            max_output_tokens=12, temperature=0)
    # r2's prompt and reply came back from its park artifact.
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens, r3.usage
    assert c.responses.retrieve(r2.id).output_text == r2.output_text
