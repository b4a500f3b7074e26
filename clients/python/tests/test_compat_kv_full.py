"""Two requests that each fit the context but not together: the shared KV
cache fills mid-generation. The youngest used to be cut there and reported
as a normal end ("stop", a structured output that did not parse); now it
waits off its sequence until there is room, then draws all it was asked."""

import threading

from compat import KEY, metrics, oai

EXTRA_ARGS = ["--api-key", KEY, "--ctx-size", "1024", "--parallel", "2", "--cache-ram-mb", "0"]


def test_two_requests_that_overfill_the_cache_both_finish_whole(daemon):
    c = oai(daemon)
    results = {}

    def go(k):
        r = c.chat.completions.create(
            model="default", max_tokens=600, temperature=1, seed=k,
            messages=[{"role": "user", "content": "Write a very long story about a dragon number %d." % k}],
            # No end of turn: each must draw its 600 tokens.
            logit_bias={"0": -100, "1": -100, "2": -100})
        results[k] = (r.choices[0].finish_reason, r.usage.completion_tokens)

    threads = [threading.Thread(target=go, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert results == {0: ("length", 600), 1: ("length", 600)}, results
    assert metrics(daemon)["superfluid_generations_preempted_total"] >= 1
    assert "the KV cache is full; it waits for room" in daemon.log()
