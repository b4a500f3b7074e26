"""The page at /web/ (issue 18), in a real browser: Playwright for Python
driving the system Chromium against a real daemon. Each test opens the page
with the daemon's token and collects console errors and uncaught exceptions;
a test fails on any it did not expect. The screenshots test writes
docs/screenshots/page-*.png, which the README shows, when
SUPERFLUID_SCREENSHOTS=1 (else into a temp dir).

Needs ``pip install playwright`` (never ``playwright install``: the browser is
Debian's ``chromium``, which scripts/setup.sh installs).
"""

import os
import re
import subprocess
import urllib.error
import urllib.request

import pytest

from superfluid_client import Sampling
from superfluid_client.daemon import Daemon, default_model

sync_api = pytest.importorskip("playwright.sync_api")

# The tools-think model: turns open with reasoning, and a forced tool call
# gives the permission request something to ask about.
MODEL = "SmolLM2-135M-tools-think.gguf"

CHROMIUM = os.environ.get("SUPERFLUID_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# The README's screenshots are rewritten only when asked
# (SUPERFLUID_SCREENSHOTS=1); otherwise they go to a temp dir, so a test run
# leaves the tree as it was.
SCREENSHOTS = (
    os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "screenshots")
    if os.environ.get("SUPERFLUID_SCREENSHOTS") == "1"
    else __import__("tempfile").mkdtemp(prefix="sf-screenshots-")
)
TIMEOUT_MS = 60_000
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# What a browser itself logs as a console error when a connection fails:
# expected only in the tests that stop the daemon or present a wrong token.
NETWORK_ERROR = re.compile(r"WebSocket connection to .* failed|net::ERR_CONNECTION_REFUSED|Failed to load resource")


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium at {} (scripts/setup.sh installs it)".format(CHROMIUM))
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A page of the browser on the daemon's /web/, and the console errors
    and exceptions it raised."""

    def __init__(self, browser, url, viewport=DESKTOP):
        self.context = browser.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.errors = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append("uncaught: {}".format(e)))
        self.page.goto(url)

    def close(self, network_errors_expected=False):
        errors = [e for e in self.errors if not (network_errors_expected and NETWORK_ERROR.search(e))]
        self.context.close()
        assert errors == [], "console errors: {}".format(errors)

    def connected(self):
        self.page.wait_for_selector("#conn.ok")

    def node(self, session):
        return self.page.locator('#tree .node[data-session="{}"]'.format(session))

    def open_session(self, session):
        self.node(session).click()
        self.page.wait_for_selector("#session-title:has-text('#{}')".format(session))


def page_url(daemon, token=None):
    return "{}/web/#token={}".format(daemon.url, token or daemon.token())


@pytest.fixture
def page(browser, daemon):
    p = Page(browser, page_url(daemon))
    p.connected()
    yield p
    p.close()


def new_sessions(sf, before):
    return sorted(set(sf.list()) - set(before))


def read(sf, session):
    return sf.call("Read", {"session": session, "cursor": 0})[1]["events"]


def kind(event):
    body = event["body"]
    return body if isinstance(body, str) else next(iter(body))


def talked(sf, text="Name three rivers.", max_tokens=24):
    """A session with a user message and one generated turn."""
    s = sf.session(Sampling(temperature=0.0, seed=1))
    s.user(text)
    s.generate(max_tokens)
    return s


# ---- serving -------------------------------------------------------------------


def test_the_page_is_served_without_a_token_and_only_to_its_own_host(daemon):
    with urllib.request.urlopen(daemon.url + "/web/") as r:
        html = r.read().decode()
        assert r.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["content-security-policy"]
    assert 'src="app.js"' in html and os.path.basename(daemon.model).rsplit(".", 1)[0] in html
    for path in ("/web/app.js", "/web/style.css"):
        with urllib.request.urlopen(daemon.url + path) as r:
            assert r.status == 200
    req = urllib.request.Request(daemon.url + "/web/", headers={"Host": "evil.example:{}".format(daemon.port)})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 403
    out = daemon.log("stdout")
    assert "{}/web/#token={}".format(daemon.url, daemon.token()) in out


def test_superfluid_open_prints_the_url(daemon):
    out = subprocess.run([daemon.binary, "open", "--no-browser", "--sessions", daemon.sessions],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == page_url(daemon)


def test_superfluid_open_refuses_a_stopped_daemons_address(daemon, tmp_path):
    """web-addr and web-token outlive their daemon (a stop, a restart
    without --web): open printed the dead URL and exited 0."""
    import shutil
    import socket as so
    s = so.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    (tmp_path / "web-addr").write_text("127.0.0.1:{}\n".format(port))
    shutil.copy(os.path.join(daemon.sessions, "web-token"), tmp_path / "web-token")
    out = subprocess.run([daemon.binary, "open", "--no-browser", "--sessions", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == "", out
    assert "no daemon answers at 127.0.0.1:{}".format(port) in out.stderr, out.stderr


def test_superfluid_open_sends_the_token_only_to_loopback(daemon, tmp_path):
    """A web-addr naming another host (`serve --web` never writes one) is
    refused before anything connects or prints: the URL carries the token,
    and open printed it for 192.0.2.2 and would have sent the browser there."""
    import shutil
    (tmp_path / "web-addr").write_text("192.0.2.2:18939\n")
    shutil.copy(os.path.join(daemon.sessions, "web-token"), tmp_path / "web-token")
    out = subprocess.run([daemon.binary, "open", "--no-browser", "--sessions", str(tmp_path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and out.stdout == "", out
    assert "names 192.0.2.2:18939, not a loopback address" in out.stderr, out.stderr


def launched(args, timeout=20):
    """What the stub xdg-open (started without waiting) was given."""
    deadline = __import__("time").monotonic() + timeout
    while not (args.exists() and args.read_text()):
        assert __import__("time").monotonic() < deadline, "xdg-open was not started"
        __import__("time").sleep(0.05)
    return args.read_text()


def lands_on_the_page(browser, url, daemon):
    p = Page(browser, url)
    p.page.wait_for_url(page_url(daemon))
    p.connected()
    p.close()


def test_superfluid_open_hands_the_browser_a_private_file_not_the_token(daemon, browser, tmp_path):
    """The token is not put on xdg-open's (or the browser's) command line,
    which other users can read: the browser gets a 0600 file in the sessions
    directory that sends it on to the page, and Chromium, opening that file,
    lands on the connected page."""
    stub = tmp_path / "xdg-open"
    args = tmp_path / "args"
    stub.write_text('#!/bin/sh\nprintf "%s" "$@" > "{}"\n'.format(args))
    stub.chmod(0o755)
    env = dict(os.environ, PATH="{}:{}".format(tmp_path, os.environ.get("PATH", "")))
    subprocess.run([daemon.binary, "open", "--sessions", daemon.sessions], env=env,
                   capture_output=True, text=True, check=True)
    given = launched(args)
    assert given.startswith("file://") and daemon.token() not in given, given
    path = given[len("file://"):]
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert page_url(daemon) in open(path).read()
    lands_on_the_page(browser, given, daemon)
    # A relative --sessions, and a folder whose name needs encoding in a URL.
    odd = tmp_path / "a b#c"
    odd.mkdir()
    for name in ("web-addr", "web-token"):
        (odd / name).write_text(open(os.path.join(daemon.sessions, name)).read())
    args.unlink()
    subprocess.run([daemon.binary, "open", "--sessions", "a b#c"], env=env, cwd=tmp_path,
                   capture_output=True, text=True, check=True)
    given = launched(args)
    assert given.startswith("file:///") and "a%20b%23c/open.html" in given, given
    lands_on_the_page(browser, given, daemon)


# ---- the page ------------------------------------------------------------------


def test_create_send_and_see_tokens_stream_then_settle(page, sf):
    p = page.page
    before = sf.list()
    p.click("#new-session")
    p.fill("#new-system", "You are a helpful assistant.")
    p.fill("#new-temperature", "0")
    p.click("#new-create")
    p.wait_for_selector("#session:not([hidden])")
    [s] = new_sessions(sf, before)
    page.node(s).wait_for()
    # Record the live turn's text at every change the page makes to it.
    p.evaluate("""() => {
        window.__live = [];
        new MutationObserver(() => {
            const live = document.querySelector('.turn.live');
            if (live) window.__live.push(live.textContent);
        }).observe(document.getElementById('events'), {subtree: true, childList: true, characterData: true});
    }""")
    # Enough tokens to span several 100 ms commits even on a fast machine.
    p.fill("#max-tokens", "128")
    p.fill("#message", "Tell me about the rivers of Europe.")
    p.keyboard.press("Control+Enter")
    p.wait_for_selector(".turn .turn-foot:has-text('tokens ·'):not(:has-text('generating'))")
    p.wait_for_function("() => !document.querySelector('.provisional')")
    seen = sorted(set(p.evaluate("window.__live")), key=len)
    assert len(seen) >= 3, "the turn grew in steps as tokens came: {}\n{}".format(seen, read(sf, s))
    # Settled: the page shows what the log committed, and the turn's numbers.
    events = read(sf, s)
    generated = [e["body"]["Generated"] for e in events if kind(e) == "Generated"]
    committed = "".join(g["text"] for g in generated if g["channel"] == 0)
    reasoning = "".join(g["text"] for g in generated if g["channel"] == 1)
    tokens = sum(len(g["span"]) for g in generated)
    foot = p.locator(".turn .turn-foot").last.inner_text()
    assert "{} tokens".format(tokens) in foot and "warm prefix" in foot, foot
    turn = p.locator(".turn").last
    shown = turn.locator(":scope > .text").all_inner_texts()
    assert "".join(shown).strip() == committed.strip()
    if reasoning:
        assert turn.locator("details.reasoning").count() >= 1
        assert not turn.locator("details.reasoning").first.evaluate("d => d.open"), "reasoning is folded"
    assert p.locator(".role-user .text").first.inner_text() == "Tell me about the rivers of Europe."
    assert p.locator(".role-system .text").first.inner_text() == "You are a helpful assistant."
    # The status strip reads Metrics.
    p.wait_for_selector("#status[data-lane='ready']")
    assert "SmolLM2-135M-tools-think" in p.inner_text("#status")


def test_fork_at_an_event_shows_the_new_branch_in_the_tree(page, sf):
    s = talked(sf)
    before = sf.list()
    p = page.page
    page.node(s.id).wait_for()
    page.open_session(s.id)
    p.click("[aria-label='fork after event 1']")
    p.wait_for_function("n => document.querySelectorAll('#tree .node').length > n", arg=len(before))
    [f] = new_sessions(sf, before)
    assert (f, s.id, 2) in sf.tree()
    node = page.node(f)
    node.wait_for()
    assert "fork at event 2" in node.inner_text()
    # Drawn under its parent.
    assert p.locator('#tree li:has(> [data-session="{}"]) ul [data-session="{}"]'.format(s.id, f)).count() == 1
    p.wait_for_selector("#session-title:has-text('#{}')".format(f))
    assert "forked from #{} at event 2".format(s.id) in p.locator(".branch-line.forked").inner_text()


def test_editing_a_message_makes_a_rebase_branch(page, sf):
    s = talked(sf)
    before = sf.list()
    p = page.page
    page.node(s.id).wait_for()
    page.open_session(s.id)
    p.click("[aria-label='edit event 1']")
    p.fill("#edit-text", "Name three mountains.")
    p.click("#edit-save")
    p.wait_for_function("n => document.querySelectorAll('#tree .node').length > n", arg=len(before))
    [r] = new_sessions(sf, before)
    events = read(sf, r)
    assert kind(events[1]) == "Rebased" and events[2]["body"]["Message"]["text"] == "Name three mountains."
    assert len(events) == 3, "what followed the message was dropped"
    assert "edit at event 1" in page.node(r).inner_text()
    p.wait_for_selector("#session-title:has-text('#{}')".format(r))
    assert p.locator(".role-user .text").inner_text() == "Name three mountains."
    # The original is untouched.
    assert read(sf, s.id)[1]["body"]["Message"]["text"] == "Name three rivers."


def test_cancel_a_long_generation(page, sf):
    s = sf.session(Sampling(temperature=0.8, seed=7))
    s.user("Write a very long story about a lighthouse keeper, in many chapters.")
    p = page.page
    page.node(s.id).wait_for()
    page.open_session(s.id)
    p.fill("#max-tokens", "4000")
    p.click("#generate")
    p.wait_for_selector("#cancel:not([hidden])")
    p.wait_for_function("() => (document.querySelector('.turn.live')?.textContent || '').length > 40")
    p.click("#cancel")
    p.wait_for_selector(".turn .turn-foot:has-text('cancelled')")
    p.wait_for_selector("#cancel[hidden]", state="attached")
    finishes = [e["body"]["Generated"]["finish"] for e in read(sf, s.id) if kind(e) == "Generated"]
    assert finishes[-1] == 4


def test_grant_a_permission_request(page, sf):
    s = sf.session(Sampling(seed=1), system="Answer with the tools.", tools=[WEATHER])
    s.user("Is it raining in Paris?")
    s.set_tool_choice("required")
    s.generate(128)
    [call] = [e for e in read(sf, s.id) if kind(e) == "ToolUse"]
    asked = sf.call("RequestPermission", {"session": s.id, "call_id": call["event_id"],
                                          "text": "Look up the weather in Paris?"})[1]["event"]
    p = page.page
    page.node(s.id).wait_for()
    page.open_session(s.id)
    p.wait_for_selector(".call:has-text('get_weather')")
    box = p.locator(".permission")
    assert "Look up the weather in Paris?" in box.inner_text()
    box.get_by_role("button", name="Grant").click()
    p.wait_for_selector(".permission .answer.granted")
    ledger = sf.call("Ledger", {"session": s.id})[1]["entries"]
    assert ledger[0]["permission"] is True
    last = read(sf, s.id)[-1]["body"]["PermissionResponded"]
    assert last == {"request_id": asked["event_id"], "granted": True}


def test_trim_pin_and_purge_with_confirmation(page, sf):
    s = talked(sf, max_tokens=4)
    before = sf.list()
    p = page.page
    page.node(s.id).wait_for()
    page.open_session(s.id)
    p.click("[aria-label='trim from event 2']")
    p.wait_for_function("n => document.querySelectorAll('#tree .node').length > n", arg=len(before))
    [t] = new_sessions(sf, before)
    assert (t, s.id, 2) in sf.tree()
    p.wait_for_selector("#session-title:has-text('#{}')".format(t))
    p.click("#pin")
    p.wait_for_selector("#pin:has-text('Unpin')")
    assert "pinned" in page.node(t).inner_text()
    # Purge asks first; Cancel keeps the session.
    p.click("#purge")
    p.wait_for_selector("#purge-dialog[open]")
    p.click("#purge-dialog button[value='cancel']")
    assert t in sf.list()
    p.click("#purge")
    p.click("#purge-confirm")
    page.node(t).wait_for(state="detached")
    assert t not in sf.list() and s.id in sf.list()


def test_keyboard_new_session_and_tree_navigation(page, sf):
    a, b = talked(sf, max_tokens=4), talked(sf, max_tokens=4)
    p = page.page
    page.node(b.id).wait_for()
    p.keyboard.press("n")
    p.wait_for_selector("#new-dialog[open]")
    p.keyboard.press("Escape")
    p.wait_for_selector("#new-dialog:not([open])", state="attached")
    page.node(a.id).focus()
    p.keyboard.press("ArrowDown")
    p.keyboard.press("Enter")
    p.wait_for_selector("#session-title:has-text('#{}')".format(b.id))


def test_a_wrong_token_shows_a_clear_message(browser, daemon):
    p = Page(browser, page_url(daemon, token="00" * 32))
    p.page.wait_for_selector("#token-message")
    assert "refused this page's token" in p.page.inner_text("#token-message")
    assert p.page.inner_text("#conn") == "token refused"
    p.close(network_errors_expected=True)
    p = Page(browser, daemon.url + "/web/")
    assert "needs the daemon's token" in p.page.inner_text("#token-message")
    p.close()


def test_archived_sessions_hide_behind_the_toggle(page, sf):
    s = talked(sf, max_tokens=4)
    p = page.page
    page.node(s.id).wait_for()
    page.open_session(s.id)
    p.click("#archive")
    page.node(s.id).wait_for(state="detached")
    p.check("#show-archived")
    assert "archived" in page.node(s.id).inner_text()


def subscribers(sf):
    line = [ln for ln in sf.metrics().splitlines() if ln.startswith("superfluid_subscribers ")][0]
    return int(float(line.split()[1]))


def test_quick_switches_between_sessions_keep_one_subscription(page, sf):
    """Opening B before A's Subscribe was answered leaked A's subscription
    (40 quick switches left 26; at 64 the page could open no session)."""
    a, b = talked(sf, max_tokens=4), talked(sf, "Name a colour.", max_tokens=4)
    for s in (a, b):
        for i in range(40):
            s.user("filler {}".format(i))
    p = page.page
    page.node(b.id).wait_for()
    p.evaluate("""async ([a, b]) => {
        const q = (i) => document.querySelector(`#tree [data-session="${i}"]`);
        for (let k = 0; k < 30; k++) {
            q(a).click();
            await new Promise((r) => setTimeout(r, 5));
            q(b).click();
            await new Promise((r) => setTimeout(r, 30));
        }
    }""", [a.id, b.id])
    p.wait_for_selector("#session-title:has-text('#{}')".format(b.id))
    deadline = __import__("time").monotonic() + 10
    while subscribers(sf) != 1 and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.2)
    assert subscribers(sf) == 1


def test_an_archived_fork_is_labelled_with_its_fork_point_and_own_words(page, sf):
    """Tree leaves archived sessions out: the page labelled an archived fork
    "fork at event null" and named it with its parent's first words."""
    s = talked(sf, "Parent words here.", max_tokens=4)
    f = s.fork(at=2)
    f.user("Child words here.")
    sf.call("SetMeta", {"session": f.id, "archived": True, "title": None,
                        "expected_version": f.inspect()["version"]})
    p = page.page
    page.node(s.id).wait_for()
    p.check("#show-archived")
    node = page.node(f.id)
    node.wait_for()
    p.wait_for_function("id => !document.querySelector(`#tree [data-session=\"${id}\"]`).innerText.includes('Parent')",
                        arg=f.id, timeout=10_000)
    text = node.inner_text()
    assert "fork at event 2" in text and "null" not in text and "Child words" in text, text


def test_restart_reconnects_and_shows_the_same_tree(browser, daemon, sf):
    s = talked(sf, max_tokens=4)
    f = s.fork()
    p = Page(browser, page_url(daemon))
    p.connected()
    p.node(f.id).wait_for()
    p.open_session(f.id)
    tree = sorted(p.page.eval_on_selector_all("#tree .node", "ns => ns.map(n => n.dataset.session)"))
    daemon.restart()
    # A new start mints a new token: the page says so and takes the new link.
    p.page.wait_for_selector("#token-message")
    p.page.fill("#token-input", page_url(daemon))
    p.page.keyboard.press("Enter")
    p.connected()
    p.node(f.id).wait_for()
    after = sorted(p.page.eval_on_selector_all("#tree .node", "ns => ns.map(n => n.dataset.session)"))
    assert after == tree
    assert "fork at event" in p.node(f.id).inner_text()
    # The open session came back, live: a message sent now shows.
    p.page.wait_for_selector("#session-title:has-text('#{}')".format(f.id))
    f.user("after the restart")
    p.page.wait_for_selector(".role-user .text:has-text('after the restart')")
    p.close(network_errors_expected=True)


# ---- screenshots ------------------------------------------------------------------


@pytest.fixture
def chat_daemon():
    """A daemon of its own on the default model (answers as text, not only
    reasoning), so the screenshots show only their own small tree."""
    model = default_model()
    if not os.path.exists(model):
        pytest.skip("no model at {}".format(model))
    d = Daemon(model=model)
    d.start()
    yield d
    d.cleanup()


def test_screenshots(browser, chat_daemon):
    """A small tree, as a new user would meet it: a conversation, a fork
    that asked a different follow-up, an edited question, and a trim."""
    daemon, sf = chat_daemon, chat_daemon.client()
    root = sf.session(Sampling(temperature=0.0, seed=3), system="You are a helpful geography tutor.")
    q = root.user("Name three rivers in Europe.")
    root.generate(40)
    second = root.user("Which one is the longest?")
    root.generate(40)
    fork = root.fork(at=second)
    fork.user("And which one flows through Vienna?")
    fork.generate(40)
    sf.call("SetMeta", {"session": root.id, "expected_version": 0, "title": "European rivers", "archived": None})
    root.edit(q, "Name three rivers in Africa.")
    root.trim(second.id + 1)
    os.makedirs(SCREENSHOTS, exist_ok=True)
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        p = Page(browser, page_url(daemon), viewport=viewport)
        p.connected()
        p.node(fork.id).wait_for()
        p.page.wait_for_selector("#status[data-lane='ready']")
        if name == "phone":
            p.page.screenshot(path=os.path.join(SCREENSHOTS, "page-phone-tree.png"))
        p.open_session(fork.id)
        p.page.wait_for_selector(".turn-foot")
        p.page.locator("#events").evaluate("e => e.scrollTop = e.scrollHeight")
        p.page.screenshot(path=os.path.join(SCREENSHOTS, "page-{}.png".format(name)))
        p.close()
    for shot in ("page-desktop.png", "page-phone.png", "page-phone-tree.png"):
        assert os.path.getsize(os.path.join(SCREENSHOTS, shot)) > 10_000
