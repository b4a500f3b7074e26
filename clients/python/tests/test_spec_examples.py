"""Every code example of the spec's "Python client" section, run as written.

The example's ``Client()`` uses its defaults: the token from
``~/.superfluid/sessions/web-token`` and http://127.0.0.1:8460. So HOME points
at a temp dir whose ``.superfluid/sessions`` is the daemon's sessions dir,
and the daemon listens on 8460 (or, when 8460 is taken, on a free port named
by SUPERFLUID_URL, which Client() honours). The example runs in a temp cwd
holding a real diff.patch and diff-v2.patch, with get_weather defined.
The example declares tools, so the module runs on the tools-think model.
"""

import os
import socket
import textwrap

import pytest

from superfluid_client.daemon import Daemon, default_model, derived_model, free_port

MODEL = "SmolLM2-135M-tools-think.gguf"
SPEC = "/work/shared/spec/session-api.md"

EXAMPLE = '''\
from superfluid_client import Client, Sampling

sf = Client()                       # http://127.0.0.1:8460, token from ~/.superfluid/sessions/web-token
s = sf.session(Sampling(temperature=0.7, seed=1), system="You are a code reviewer.")
q = s.user(open("diff.patch").read())

for chunk in s.stream(max_tokens=512):          # token by token; chunk.kind is "text" or "reasoning"
    print(chunk.text, end="")

security = s.fork_after(q, seed=2)              # the diff is shared by reference and starts warm
security.user("Focus on security.")
print(security.generate(512).text)

fixed = s.edit(q, open("diff-v2.patch").read()) # a new branch with the message replaced
again = sf.get(s.id)                            # the same session, after a restart too

weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
s = sf.session(system="Answer with the tools.", tools=[weather])
s.user("Is it raining in Paris?")
reply = s.generate(256)
for call in reply.tool_calls:                   # ToolCall(id, name, arguments)
    s.tool_result(call, get_weather(**call.json()))   # your function, returning a string
print(s.generate(256).text)
'''

DIFF = textwrap.dedent('''\
    --- a/app/login.py
    +++ b/app/login.py
    @@ -1,9 +1,12 @@
     import sqlite3
    +import hashlib
     
     def login(db, user, password):
    -    row = db.execute("SELECT hash FROM users WHERE name = ?", (user,)).fetchone()
    -    return row is not None and row[0] == hashlib.sha256(password.encode()).hexdigest()
    +    query = "SELECT hash FROM users WHERE name = '%s'" % user
    +    row = db.execute(query).fetchone()
    +    if row is None:
    +        return False
    +    return row[0] == hashlib.md5(password.encode()).hexdigest()
    ''')

DIFF_V2 = textwrap.dedent('''\
    --- a/app/login.py
    +++ b/app/login.py
    @@ -1,9 +1,11 @@
     import sqlite3
    +import hmac, hashlib
     
     def login(db, user, password):
         row = db.execute("SELECT hash FROM users WHERE name = ?", (user,)).fetchone()
    -    return row is not None and row[0] == hashlib.sha256(password.encode()).hexdigest()
    +    if row is None:
    +        return False
    +    return hmac.compare_digest(row[0], hashlib.sha256(password.encode()).hexdigest())
    ''')


def get_weather(city="somewhere", **_):
    """The example's tool: a string, as the spec asks. (A forced call's
    arguments are any JSON object, not checked against the tool's
    parameters, so the 135M model's ``city`` may be missing.)"""
    get_weather.calls.append(city)
    return "Light rain in {}, 14 C".format(city)


get_weather.calls = []


def port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def spec_home(tmp_path_factory):
    """HOME with .superfluid/sessions, a daemon serving it with the example's defaults."""
    model = derived_model(MODEL)
    if not os.path.exists(model):
        pytest.skip("no model at {}".format(model))
    home = tmp_path_factory.mktemp("home")
    port = 8460 if port_free(8460) else free_port()
    d = Daemon(model=model, dir=str(home / ".superfluid"), port=port)
    d.start()
    yield home, d
    d.cleanup()


@pytest.fixture
def example_env(spec_home, tmp_path, monkeypatch):
    home, d = spec_home
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SUPERFLUID_SESSIONS", raising=False)
    if d.port == 8460:
        monkeypatch.delenv("SUPERFLUID_URL", raising=False)
    else:
        monkeypatch.setenv("SUPERFLUID_URL", d.url)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "diff.patch").write_text(DIFF)
    (tmp_path / "diff-v2.patch").write_text(DIFF_V2)
    return d


def test_the_example_is_the_specs():
    if not os.path.exists(SPEC):
        pytest.skip("the spec is not on this machine")
    with open(SPEC) as f:
        spec = f.read()
    for line in EXAMPLE.splitlines():
        assert line in spec, "the spec's example changed: {!r}".format(line)


def test_python_client_example_runs_as_written(example_env, capsys):
    scope = {"get_weather": get_weather, "__name__": "example"}
    exec(compile(EXAMPLE, "session-api.md (Python client)", "exec"), scope)
    out = capsys.readouterr().out
    assert out.strip(), "the example printed the replies"
    sf, first, fixed, again = scope["sf"], scope["q"], scope["fixed"], scope["again"]
    # The branches the example made, checked from the log.
    assert [m.text for m in fixed.messages() if m.role == "user"] == [DIFF_V2]
    assert again.events()[first.id] == first
    security = scope["security"]
    assert security.events()[first.id] == first
    assert [m.text for m in security.messages() if m.role == "user"] == [DIFF, "Focus on security."]
    tools_session = scope["s"]
    assert tools_session.events()[1].kind == "System"
    # Every call the model made was answered by get_weather.
    assert tools_session.open_tool_calls() == []


def test_python_client_example_with_a_forced_tool_call(example_env, capsys):
    """The tools half with the call forced (SetToolChoice "required"), so the
    for loop runs get_weather and the model answers after its result."""
    forced = EXAMPLE.split("weather = ", 1)[1]
    forced = "weather = " + forced.replace(
        'reply = s.generate(256)', 's.set_tool_choice("required")\nreply = s.generate(256)\ns.set_tool_choice("auto")')
    scope = {"get_weather": get_weather, "__name__": "example"}
    exec("from superfluid_client import Client, Sampling\nsf = Client()\n" + forced, scope)
    reply, s = scope["reply"], scope["s"]
    assert reply.finish == 3 and [c.name for c in reply.tool_calls] == ["get_weather"]
    assert isinstance(reply.tool_calls[0].json(), dict)
    results = [e for e in s.events() if e.kind == "ToolResult"]
    assert [r.data["call_id"] for r in results] == [reply.tool_calls[0].id]
    assert results[0].data["content"].startswith("Light rain in")
    assert s.open_tool_calls() == []
    assert s.messages()[-1].role == "assistant"
