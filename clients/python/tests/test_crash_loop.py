"""The crash loop (crash_loop.py) with 50 kills: no committed event lost or altered."""

import crash_loop


def test_crash_loop():
    r = crash_loop.run(kills=50)
    print("kills: {kills}, events checked: {checked} ({distinct_events} distinct), lost or altered: "
          "{lost_or_altered}; {generations} generations, {stream_events} streamed events, {seconds:.0f}s, seed {seed}".format(**r))
    assert r["kills"] == 50
    assert r["problems"] == [], "\n".join(r["problems"][:10])
    assert r["worker_failures"] == []
    assert r["distinct_events"] > 100
    # The loop really generated and really checked streamed events (it
    # cannot pass with every stream failing).
    assert r["generations"] > 0
    assert r["stream_events"] > 0
