"""A client of superfluid's session API over its browser transport.

The daemon keeps sessions as durable event logs. This client speaks to the
``--web`` listener: one JSON request per ``POST /web/rpc`` and generation over
``POST /web/stream`` (server-sent events). It uses only the standard library.

    from superfluid_client import Client, Sampling

    sf = Client()                    # http://127.0.0.1:8460, token from ~/.superfluid/sessions/web-token
    s = sf.session(Sampling(temperature=0.7, seed=1), system="You are terse.")
    s.user("Name three rivers.")
    for chunk in s.stream(max_tokens=128):
        print(chunk.text, end="")

Every reply the daemon refuses (``{"Err": {"message": ...}}``) raises
:class:`SuperfluidError`; HTTP 401/403 raise :class:`Unauthorized` /
:class:`Forbidden`, 429 raises :class:`Throttled`, and a daemon that cannot be
reached (or dies mid-stream) raises :class:`Disconnected`.
"""

import http.client
import json
import os
import urllib.parse
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = [
    "Client",
    "Sampling",
    "Session",
    "Reply",
    "ToolCall",
    "Chunk",
    "Event",
    "Message",
    "Stream",
    "SuperfluidError",
    "HTTPError",
    "Unauthorized",
    "Forbidden",
    "Throttled",
    "Disconnected",
    "ROLE",
    "CHANNEL",
    "FINISH",
    "drop",
    "replace",
]

__version__ = "0.1.0"

DEFAULT_URL = "http://127.0.0.1:8460"
DEFAULT_SESSIONS_DIR = os.path.join("~", ".superfluid", "sessions")

#: Roles on the wire.
ROLE = {"system": 0, "user": 1, "assistant": 2, "tool": 3}
ROLE_NAME = {v: k for k, v in ROLE.items()}
#: Channels of generated text on the wire.
CHANNEL = {0: "text", 1: "reasoning", 2: "tool_call"}
#: Finish codes on the wire.
FINISH = {0: "open", 1: "end_of_turn", 2: "max_tokens", 3: "grammar", 4: "cancelled", 5: "error"}


# ---- errors -----------------------------------------------------------------


class SuperfluidError(Exception):
    """The daemon refused a request: its ``Err`` message (or an HTTP error's)."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.message = message
        self.status = status


class HTTPError(SuperfluidError):
    """A non-200 answer from the listener; ``status`` holds the HTTP status."""


class Unauthorized(HTTPError):
    """401: a missing or wrong token."""


class Forbidden(HTTPError):
    """403: a wrong CSRF header, an unlisted Origin or a wrong Host."""


class Throttled(HTTPError):
    """429: a ``Complete`` past the listener's bucket; retry after ``retry_after_ms``."""

    def __init__(self, message: str, retry_after_ms: int, status: int = 429):
        super().__init__(message, status)
        self.retry_after_ms = retry_after_ms


class Disconnected(SuperfluidError, ConnectionError):
    """The daemon could not be reached, or the connection broke mid-reply."""


# ---- values -----------------------------------------------------------------


@dataclass
class Sampling:
    """A session's sampling parameters; all five are always sent.

    ``temperature=0`` is greedy; ``top_k=0`` disables top-k.
    """

    temperature: float = 0.7
    top_p: float = 0.95
    min_p: float = 0.0
    top_k: int = 0
    seed: int = 0

    def to_wire(self) -> Dict[str, Any]:
        """The JSON ``Params`` object."""
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "min_p": float(self.min_p),
            "top_k": int(self.top_k),
            "seed": int(self.seed),
        }

    @classmethod
    def from_wire(cls, params: Dict[str, Any]) -> "Sampling":
        """Builds a Sampling from a JSON ``Params`` object."""
        return cls(
            temperature=params["temperature"],
            top_p=params["top_p"],
            min_p=params["min_p"],
            top_k=params["top_k"],
            seed=params["seed"],
        )


class Event:
    """One committed event of a session's log.

    ``id`` is its event id, ``kind`` the record's name (``"Message"``,
    ``"Generated"``, ``"EpochBump"``...), ``data`` the record's fields (empty
    for a record without fields) and ``raw`` the event exactly as received.
    Two events are equal when their JSON is.
    """

    __slots__ = ("raw",)

    def __init__(self, raw: Dict[str, Any]):
        self.raw = raw

    @property
    def id(self) -> int:
        """The event id (``event_id``)."""
        return self.raw["event_id"]

    @property
    def epoch(self) -> int:
        """The daemon start that committed it."""
        return self.raw["epoch"]

    @property
    def ts_unix_ms(self) -> int:
        """When it was committed."""
        return self.raw["ts_unix_ms"]

    @property
    def body(self) -> Union[str, Dict[str, Any]]:
        """The record as on the wire: ``{"Name": {...}}`` or ``"Name"``."""
        return self.raw["body"]

    @property
    def kind(self) -> str:
        """The record's variant name."""
        body = self.raw["body"]
        return body if isinstance(body, str) else next(iter(body))

    @property
    def data(self) -> Dict[str, Any]:
        """The record's fields (``{}`` for a record without any)."""
        body = self.raw["body"]
        return {} if isinstance(body, str) else body[self.kind]

    @property
    def text(self) -> Optional[str]:
        """The record's ``text`` field, if it has one."""
        return self.data.get("text")

    @property
    def role(self) -> Optional[int]:
        """The record's ``role`` field, if it has one."""
        return self.data.get("role")

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Event):
            return self.raw == other.raw
        if isinstance(other, dict):
            return self.raw == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(json.dumps(self.raw, sort_keys=True))

    def __repr__(self) -> str:
        return "Event(id={}, {})".format(self.id, json.dumps(self.body)[:200])


@dataclass
class ToolCall:
    """A tool call the model made: ``id`` is its ``ToolUse`` event id (the
    ``call_id`` a result answers), ``arguments`` the JSON text."""

    id: int
    name: str
    arguments: str

    def json(self) -> Any:
        """The arguments parsed from JSON (``{}`` when empty)."""
        return json.loads(self.arguments) if self.arguments.strip() else {}


@dataclass
class Chunk:
    """A piece of a streamed reply: ``kind`` is ``"text"``, ``"reasoning"``
    or ``"tool_call"``; ``call`` is set on the chunk that completes a tool call."""

    kind: str
    text: str
    call: Optional[ToolCall] = None


@dataclass
class Reply:
    """A finished generation.

    ``text`` and ``reasoning`` join the committed text of channels 0 and 1,
    ``tool_calls`` are the calls the model made, ``finish`` the finish code
    (1 end of turn, 2 max_tokens, 3 grammar, 4 cancelled, 5 error),
    ``tokens`` the tokens generated and ``warm_prefix`` the prompt tokens
    that came from the cache. ``events`` are the committed events.
    """

    text: str = ""
    reasoning: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)
    finish: Optional[int] = None
    tokens: int = 0
    warm_prefix: int = 0
    events: List[Event] = field(default_factory=list)


@dataclass
class Message:
    """A message folded from the log: ``role`` is ``"system"``, ``"user"``,
    ``"assistant"`` or ``"tool"``; an assistant message also has
    ``reasoning`` and ``tool_calls``; a tool message ``call_id``;
    ``events`` lists the ids of the events it was folded from."""

    role: str
    text: str
    reasoning: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)
    call_id: Optional[int] = None
    tools: List[str] = field(default_factory=list)
    events: List[int] = field(default_factory=list)


def drop(from_: int, to: int) -> Dict[str, Any]:
    """A Rebase edit leaving out events ``from_ .. to - 1``."""
    return {"Drop": {"from": int(from_), "to": int(to)}}


def replace(from_: int, to: int, role: Union[int, str], text: str) -> Dict[str, Any]:
    """A Rebase edit replacing events ``from_ .. to - 1`` with one message."""
    return {"Replace": {"from": int(from_), "to": int(to), "role": _role(role), "text": text}}


def _role(role: Union[int, str]) -> int:
    return ROLE[role] if isinstance(role, str) else int(role)


def _event_id(event: Union["Event", int]) -> int:
    return event.id if isinstance(event, Event) else int(event)


# ---- the client -------------------------------------------------------------


class Client:
    """A connection to a daemon's browser transport.

    ``url`` is the listener (``--web``; default ``SUPERFLUID_URL``, else
    ``http://127.0.0.1:8460``), ``token`` its token; without one the token is
    read from ``<sessions_dir>/web-token`` (default ``SUPERFLUID_SESSIONS``,
    else ``~/.superfluid/sessions``), and read again when the daemon answers 401,
    since a restarted daemon writes a new one. ``timeout`` bounds each socket
    operation, in seconds. ``model`` picks which of the daemon's models
    (``serve --model``) the requests go to: its id, or ``None`` for the first;
    each model has its own sessions. Each request uses its own HTTP
    connection, so one Client may be shared by threads.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        timeout: float = 120.0,
        sessions_dir: Optional[str] = None,
        model: Optional[str] = None,
    ):
        url = url or os.environ.get("SUPERFLUID_URL") or DEFAULT_URL
        parsed = urllib.parse.urlsplit(url if "//" in url else "http://" + url)
        if parsed.scheme != "http":
            raise ValueError("only http:// listeners exist: {}".format(url))
        self.url = url
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self.timeout = timeout
        self.model = model
        self._query = "" if model is None else "?" + urllib.parse.urlencode({"model": model})
        self._token_path = None
        self._token_error = None
        if token is None:
            self._token_path = os.path.join(
                os.path.expanduser(sessions_dir or os.environ.get("SUPERFLUID_SESSIONS") or DEFAULT_SESSIONS_DIR),
                "web-token",
            )
            token = self._read_token()
        self.token = token.strip() if token else ""

    # -- plumbing ---------------------------------------------------------

    def _read_token(self) -> str:
        self._token_error = None
        try:
            with open(self._token_path) as f:
                return f.read().strip()
        except OSError as e:
            self._token_error = e.strerror or str(e)
            return ""

    def _token_source(self) -> str:
        """Where the token came from, for a 401's message."""
        if self._token_path is None:
            return "the token was given to Client()"
        if self._token_error is not None:
            return "no token: {} could not be read ({}); pass sessions_dir= or token=".format(
                self._token_path, self._token_error)
        return "the token was read from {}; is the daemon serving that sessions directory?".format(
            self._token_path)

    def _headers(self) -> Dict[str, str]:
        return {
            "content-type": "application/json",
            "authorization": "Bearer " + self.token,
            "x-superfluid-csrf": self.token,
        }

    def _post(self, path: str, body: Any) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Posts JSON; returns the open connection and its response, status
        checked. Retries once with a re-read token on 401."""
        data = json.dumps(body).encode()
        for attempt in (0, 1):
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                conn.request("POST", path + self._query, body=data, headers=self._headers())
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise Disconnected("{} {}: {}".format(path, self.url, e)) from e
            if resp.status == 200:
                return conn, resp
            try:
                payload = resp.read()
            except (OSError, http.client.HTTPException):
                payload = b""
            finally:
                conn.close()
            if resp.status == 401 and attempt == 0 and self._token_path:
                fresh = self._read_token()
                if fresh and fresh != self.token:
                    self.token = fresh
                    continue
            error = _http_error(resp, payload)
            if isinstance(error, Unauthorized):
                error = Unauthorized("{} ({})".format(error, self._token_source()), 401)
            raise error
        raise AssertionError("unreachable")

    def call(self, verb: str, args: Optional[Dict[str, Any]] = None) -> Tuple[str, Any]:
        """Sends one raw request on ``/web/rpc``: ``call("Read", {"session": 1,
        "cursor": 0})``, or ``call("Tree")`` for a request without fields.
        Returns ``(variant, payload)`` of the reply, such as ``("Events",
        {"events": [...]})`` or ``("Cancelling", None)``. An ``Err`` reply
        raises :class:`SuperfluidError`, a ``Throttled`` one :class:`Throttled`.
        """
        request = verb if args is None else {verb: args}
        conn, resp = self._post("/web/rpc", request)
        try:
            payload = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise Disconnected("/web/rpc {}: {}".format(self.url, e)) from e
        finally:
            conn.close()
        try:
            reply = json.loads(payload)
        except ValueError as e:
            raise SuperfluidError("not a JSON reply: {!r}".format(payload[:200])) from e
        if isinstance(reply, str):
            return reply, None
        variant, value = next(iter(reply.items()))
        if variant == "Err":
            raise SuperfluidError(value["message"])
        if variant == "Throttled":
            raise Throttled("throttled", value["retry_after_ms"], 200)
        return variant, value

    def _expect(self, want: str, verb: str, args: Optional[Dict[str, Any]] = None) -> Any:
        variant, payload = self.call(verb, args)
        if variant != want:
            raise SuperfluidError("{} answered {} instead of {}: {}".format(verb, variant, want, payload))
        return payload

    # -- sessions ---------------------------------------------------------

    def session(
        self,
        sampling: Optional[Sampling] = None,
        system: Optional[str] = None,
        tools: Optional[Sequence[Union[Dict[str, Any], str]]] = None,
        parent: Optional[int] = None,
    ) -> "Session":
        """Creates a session (``Create``) with ``sampling`` (default
        :class:`Sampling`), opening it with a system turn (``AppendSystem``)
        when ``system`` or ``tools`` is given. ``parent`` only files it under
        another session in the tree."""
        sampling = sampling or Sampling()
        created = self._expect("Created", "Create", {"parent": parent, "params": sampling.to_wire()})
        s = Session(self, created["session"])
        if system is not None or tools:
            s.declare(system=system, tools=tools)
        return s

    def get(self, id: int) -> "Session":
        """The session ``id``, checked to exist (``Inspect``); it survives
        restarts. Raises :class:`SuperfluidError` for an unknown session."""
        s = Session(self, int(id))
        s.inspect()
        return s

    def list(self) -> List[int]:
        """The id of every session neither purged nor archived (``List``)."""
        return self._expect("Sessions", "List")["ids"]

    def sessions(self, include_archived: bool = False) -> List[Dict[str, Any]]:
        """Summaries of the sessions (``Sessions``)."""
        return self._expect("SessionList", "Sessions", {"include_archived": include_archived})["sessions"]

    def put_media(self, data: bytes, mime: Optional[str] = None) -> str:
        """Stores image bytes in the daemon's media store (``PutMedia``) and
        returns their SHA-256 hash. ``mime`` defaults to the type sniffed
        from the bytes (PNG, JPEG, WebP or GIF); the daemon checks the two
        agree. Over this JSON transport an image is at most about 4 MiB
        (docs/media.md)."""
        data = bytes(data)
        return self._expect("Media", "PutMedia", {"bytes": list(data), "mime": mime or _sniff_image(data)})["hash"]

    def gc_media(self) -> Tuple[int, int]:
        """Removes blobs no live session references (``GcMedia``): (kept, removed)."""
        r = self._expect("Gc", "GcMedia")
        return r["kept"], r["removed"]

    def tree(self) -> List[Tuple[int, Optional[int], Optional[int]]]:
        """The fork tree (``Tree``): ``(id, parent, fork_at)`` per session."""
        return [tuple(n) for n in self._expect("Tree", "Tree")["nodes"]]

    def models(self) -> List[Dict[str, Any]]:
        """The daemon's models (``Models``): ``id``, ``file``, ``default``
        (the first) and ``state`` ("ready", "loading", "respawning" or
        "unloaded") of each."""
        return self._expect("Models", "Models")["models"]

    def metrics(self) -> str:
        """The Prometheus exposition (``Metrics``)."""
        return self._expect("Text", "Metrics")["text"]

    def health(self) -> bool:
        """True when ``/web/health`` answers 200 (no token needed)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("GET", "/web/health")
            resp = conn.getresponse()
            resp.read()
            return resp.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def __repr__(self) -> str:
        return "Client({!r})".format(self.url)


def _http_error(resp: http.client.HTTPResponse, payload: bytes) -> HTTPError:
    message = "HTTP {}".format(resp.status)
    retry_after_ms = None
    try:
        body = json.loads(payload)
        if "Err" in body:
            message = "HTTP {}: {}".format(resp.status, body["Err"]["message"])
        if "Throttled" in body:
            retry_after_ms = int(body["Throttled"]["retry_after_ms"])
    except (ValueError, TypeError, KeyError, AttributeError):
        if payload:
            message = "HTTP {}: {}".format(resp.status, payload[:200].decode(errors="replace"))
    if resp.status == 401:
        return Unauthorized(message, 401)
    if resp.status == 403:
        return Forbidden(message, 403)
    if resp.status == 429:
        if retry_after_ms is None:
            retry_after_ms = int(float(resp.getheader("retry-after") or 1) * 1000)
        return Throttled(message, retry_after_ms, 429)
    return HTTPError(message, resp.status)


# ---- streaming --------------------------------------------------------------


# How long a Stream dropped unfinished (a ``for`` loop left early, garbage
# collection) waits for its session to be free after its Cancel.
_DROPPED_STREAM_WAIT = 10.0


class Stream:
    """One generation on ``/web/stream``, iterated as :class:`Chunk` s.

    With ``provisional`` (the default of :meth:`Session.stream`) text arrives
    token by token ahead of its commit; committed text then fills in what the
    provisional text had not shown, so the chunks add up to the committed
    text (every drawn token's text arrives provisionally first).
    ``reply.text`` is always the committed text.
    ``committed`` lists every committed event received so far
    (also after a broken connection), ``reply`` is the :class:`Reply` once the
    stream ended. Closing the stream early (``close()``, leaving a ``for``
    loop, or a ``with`` block) closes the connection and cancels the
    generation (``Cancel``; finish 4), and returns once the session is free
    for its next request.
    """

    def __init__(self, session: "Session", max_tokens: int, provisional: bool = True):
        self.session = session
        self.max_tokens = max_tokens
        self.provisional = provisional
        self._state = _StreamState()
        # The generator holds the state, not the Stream, so dropping the
        # Stream (leaving a for loop) frees it at once and closes the socket.
        body = {"session": session.id, "max_tokens": int(max_tokens), "provisional": bool(provisional)}
        self._gen = _run_stream(session.client, body, self._state)

    @property
    def committed(self) -> List[Event]:
        """The committed events received so far."""
        return self._state.committed

    @property
    def reply(self) -> Optional[Reply]:
        """The :class:`Reply` once the stream ended, else None."""
        return self._state.reply

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        return next(self._gen)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close(wait=_DROPPED_STREAM_WAIT)
        except Exception:
            pass

    def close(self) -> None:
        """Closes the connection; a generation still running is cancelled,
        and this returns once the session is free (or the client's timeout
        passed)."""
        self._close(wait=None)

    def _close(self, wait: Optional[float]) -> None:
        running = self._state.running
        self._state.running = False
        # The connection first: from another thread the generator may be
        # running (then it ends on the closed connection).
        self._state.close()
        try:
            self._gen.close()
        except ValueError:
            pass
        if running:
            self.session._stop_generation(wait)

    def finish(self) -> Reply:
        """Reads the stream to its end and returns the :class:`Reply`."""
        for _ in self._gen:
            pass
        if self._state.reply is None:
            raise Disconnected("the stream ended without a result")
        return self._state.reply


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _StreamState:
    def __init__(self) -> None:
        self.committed: List[Event] = []
        self.reply: Optional[Reply] = None
        self.conn: Optional[http.client.HTTPConnection] = None
        # The generation was asked for and has not ended as far as the
        # stream knows (no done or error line yet).
        self.running = False

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


def _run_stream(client: Client, body: Dict[str, Any], state: _StreamState) -> Iterator[Chunk]:
    state.conn, resp = client._post("/web/stream", body)
    state.running = True
    reply = Reply(events=state.committed)
    # Per channel: provisional text shown that no commit has covered yet.
    shown: Dict[int, str] = {}
    ended = False
    try:
        while True:
            try:
                line = resp.readline()
            except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
                raise Disconnected("/web/stream broke: {}".format(e)) from e
            if not line:
                break
            line = line.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                ended = True
                break
            msg = json.loads(data)
            if "provisional" in msg:
                p = msg["provisional"]
                channel, text = p["channel"], p["text"]
                shown[channel] = shown.get(channel, "") + text
                if text:
                    yield Chunk(CHANNEL.get(channel, str(channel)), text)
            elif "committed" in msg:
                event = Event(msg["committed"])
                state.committed.append(event)
                kind, d = event.kind, event.data
                if kind == "Generated":
                    channel, text = d["channel"], d["text"]
                    if channel == 0:
                        reply.text += text
                    elif channel == 1:
                        reply.reasoning += text
                    before = shown.get(channel, "")
                    n = _common_prefix(before, text)
                    if n == len(text):  # provisional text ran ahead of this commit
                        rest, shown[channel] = "", before[n:]
                    else:
                        # The commit holds text the provisional lines did not
                        # show (yet): show it now. What was shown past the
                        # point where they part stays shown, for the next commit.
                        rest, shown[channel] = text[n:], before[n:]
                    if rest:
                        yield Chunk(CHANNEL.get(channel, str(channel)), rest)
                elif kind == "ToolUse":
                    call = ToolCall(event.id, d["name"], d["arguments"])
                    reply.tool_calls.append(call)
                    yield Chunk("tool_call", "", call)
            elif "done" in msg:
                state.running = False
                d = msg["done"]
                reply.finish = d["finish"]
                reply.tokens = d["tokens_generated"]
                reply.warm_prefix = d["warm_prefix"]
            elif "error" in msg:
                state.running = False
                raise SuperfluidError(msg["error"])
        if not ended or reply.finish is None:
            raise Disconnected("/web/stream ended before its result")
        state.reply = reply
    finally:
        state.close()


# ---- sessions ---------------------------------------------------------------


def _sniff_image(data: bytes) -> str:
    """The MIME type of image bytes, from their signature."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    raise SuperfluidError("not a PNG, JPEG, WebP or GIF image")


class Session:
    """One session of the daemon, by id; every method is one request.

    Sessions live in the daemon's log: ``Client.get(id)`` finds the same one
    after a restart.
    """

    def __init__(self, client: Client, id: int):
        self.client = client
        self.id = id

    def __repr__(self) -> str:
        return "Session({})".format(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Session) and other.id == self.id and other.client is self.client

    def __hash__(self) -> int:
        return hash(self.id)

    def _committed(self, verb: str, args: Dict[str, Any]) -> Event:
        return Event(self.client._expect("Committed", verb, dict(session=self.id, **args))["event"])

    def _created(self, verb: str, args: Dict[str, Any]) -> "Session":
        return Session(self.client, self.client._expect("Created", verb, dict(session=self.id, **args))["session"])

    # -- appending --------------------------------------------------------

    def message(self, role: Union[int, str], text: str) -> Event:
        """Appends a message of ``role`` (``AppendMessage``); returns its event."""
        return self._committed("AppendMessage", {"role": _role(role), "text": text})

    def user(self, text: str) -> Event:
        """Appends a user message; returns the committed event."""
        return self.message(1, text)

    def system(self, text: str) -> Event:
        """Appends a system message; returns the committed event."""
        return self.message(0, text)

    def assistant(self, text: str) -> Event:
        """Appends an assistant message; returns the committed event."""
        return self.message(2, text)

    def image(
        self,
        image: Union[str, bytes, "os.PathLike[str]"],
        pre_text: str = "",
        post_text: str = "",
        role: Union[int, str] = "user",
    ) -> Event:
        """Appends an image message (``AppendImage``): ``image`` is a file's
        path, raw bytes, or a ``PutMedia`` hash (64 hex digits); bytes and
        files are stored first (``Client.put_media``). The image goes between
        ``pre_text`` and ``post_text``. Needs a model with a vision projector
        (``serve --mmproj``)."""
        if isinstance(image, str) and len(image) == 64 and all(c in "0123456789abcdef" for c in image):
            blob = image
        elif isinstance(image, (bytes, bytearray)):
            blob = self.client.put_media(bytes(image))
        else:
            with open(image, "rb") as f:
                blob = self.client.put_media(f.read())
        return self._committed(
            "AppendImage", {"role": _role(role), "blob": blob, "pre_text": pre_text, "post_text": post_text}
        )

    def append(self, text: Optional[str] = None, span: Sequence[int] = ()) -> Event:
        """Appends raw text or token ids outside the template (``Append``)."""
        return self._committed("Append", {"text": text, "span": [int(t) for t in span]})

    def declare(
        self, system: Optional[str] = None, tools: Optional[Sequence[Union[Dict[str, Any], str]]] = None
    ) -> Event:
        """Opens the session with a system turn declaring ``tools``
        (``AppendSystem``); each tool is a dict or a JSON string. Refused once
        the session has any input."""
        specs = [t if isinstance(t, str) else json.dumps(t) for t in (tools or [])]
        return self._committed("AppendSystem", {"text": system, "tools": specs})

    def set_tool_choice(self, choice: str) -> Event:
        """How later generations may call tools: ``"auto"``, ``"required"``
        or a tool's name (``SetToolChoice``, an extension of the spec)."""
        return self._committed("SetToolChoice", {"choice": choice})

    def set_output_format(self, schema: Optional[Union[str, Dict[str, Any]]]) -> Event:
        """The JSON schema (a dict or JSON text) later generations' output
        follows, forced by a grammar; ``None`` sets it back to free text
        (``SetOutputFormat``, an extension of the spec)."""
        text = schema if schema is None or isinstance(schema, str) else json.dumps(schema)
        return self._committed("SetOutputFormat", {"schema": text})

    # -- generating -------------------------------------------------------

    def stream(self, max_tokens: int = 256, provisional: bool = True) -> Stream:
        """Generates the next turn, or continues an open one, on
        ``/web/stream``: iterate the returned :class:`Stream` for
        :class:`Chunk` s (token by token with ``provisional``). Leaving the
        loop early closes the connection, which cancels the generation."""
        return Stream(self, max_tokens, provisional)

    def generate(self, max_tokens: int = 256) -> Reply:
        """Generates the next turn (or continues an open one) and returns the
        :class:`Reply` once it ended."""
        return Stream(self, max_tokens, provisional=False).finish()

    def cancel(self) -> None:
        """Stops the generation in flight (``Cancel``); raises
        :class:`SuperfluidError` when nothing is generating."""
        self.client.call("Cancel", {"session": self.id})

    def _stop_generation(self, wait: Optional[float] = None) -> None:
        """What leaving a stream early does: ``Cancel`` (the daemon would
        see the closed connection only at a later reply), then waits until
        ``Inspect`` says nothing generates, within ``wait`` seconds (the
        client's timeout by default). Errors (the generation ended
        meanwhile, the daemon is gone) end it."""
        try:
            self.client.call("Cancel", {"session": self.id})
        except SuperfluidError:
            pass
        deadline = time.monotonic() + (self.client.timeout if wait is None else wait)
        try:
            while self.inspect().get("generating") and time.monotonic() < deadline:
                time.sleep(0.01)
        except SuperfluidError:
            pass

    # -- branching --------------------------------------------------------

    def fork(self, at: Optional[Union[Event, int]] = None, seed: Optional[int] = None) -> "Session":
        """A new session holding this one's events before ``at`` (an event
        id; default: all of them), shared by reference. ``seed`` gives the
        fork its own seed; otherwise it keeps this session's params."""
        info = self.inspect() if (at is None or seed is not None) else None
        at_event = info["events"] if at is None else _event_id(at)
        params = None
        if seed is not None:
            params = dict(info["params"], seed=int(seed))
        return self._created("Fork", {"at_event": at_event, "params": params})

    def fork_after(self, event: Union[Event, int], seed: Optional[int] = None) -> "Session":
        """A fork holding the events up to and including ``event``."""
        return self.fork(at=_event_id(event) + 1, seed=seed)

    def edit(self, event: Union[Event, int], text: str, role: Optional[Union[int, str]] = None) -> "Session":
        """A new session with the message ``event`` replaced by ``text`` and
        what followed it dropped (``Rebase``). The role is the message's own
        unless ``role`` is given."""
        at = _event_id(event)
        events = self.events()
        if role is None:
            original = event if isinstance(event, Event) else events[at]
            role = original.role if original.role is not None else 1
        return self.rebase([replace(at, len(events), role, text)])

    def rebase(self, edits: Sequence[Dict[str, Any]], sampling: Optional[Sampling] = None) -> "Session":
        """A new session with ``edits`` applied (``Rebase``): each edit is
        :func:`drop` ``(from, to)`` or :func:`replace` ``(from, to, role,
        text)`` (or the same JSON dict), half-open, sorted, never event 0."""
        params = sampling.to_wire() if sampling else None
        return self._created("Rebase", {"edits": list(edits), "params": params})

    def trim(self, to_event: Union[Event, int]) -> "Session":
        """A new session holding the events before ``to_event`` (``Trim``)."""
        return self._created("Trim", {"to_event": _event_id(to_event)})

    # -- reading ----------------------------------------------------------

    def events(self, cursor: int = 0) -> List[Event]:
        """The log from event ``cursor`` on (``Read``)."""
        return [Event(e) for e in self.client._expect("Events", "Read", {"session": self.id, "cursor": int(cursor)})["events"]]

    def messages(self) -> List[Message]:
        """The log folded into messages: system, user, assistant (text,
        reasoning and tool calls of one turn together) and tool results."""
        out: List[Message] = []
        turn: Optional[Message] = None
        for e in self.events():
            k, d = e.kind, e.data
            if k == "System":
                out.append(Message("system", d.get("text") or "", tools=list(d["tools"]), events=[e.id]))
                turn = None
            elif k in ("Message", "Block", "Image"):
                text = d.get("text", d.get("payload", ""))
                msg = Message(ROLE_NAME.get(d["role"], str(d["role"])), text or "", events=[e.id])
                out.append(msg)
                turn = msg if msg.role == "assistant" else None
            elif k == "GenerationPrompt":
                turn = Message("assistant", "", events=[e.id])
                out.append(turn)
            elif k in ("Generated", "ToolUse"):
                if turn is None:
                    turn = Message("assistant", "")
                    out.append(turn)
                turn.events.append(e.id)
                if k == "ToolUse":
                    turn.tool_calls.append(ToolCall(e.id, d["name"], d["arguments"]))
                elif d["channel"] == 0:
                    turn.text += d["text"]
                elif d["channel"] == 1:
                    turn.reasoning += d["text"]
            elif k == "ToolResult":
                out.append(Message("tool", d["content"], call_id=d["call_id"], events=[e.id]))
                turn = None
        return out

    def inspect(self) -> Dict[str, Any]:
        """The session's ``Inspection``: params, events, tokens, open_turn..."""
        return self.client._expect("Inspection", "Inspect", {"session": self.id})["inspection"]

    # -- tools ------------------------------------------------------------

    def tool_result(self, call: Union[ToolCall, int], content: Any) -> Event:
        """Answers the tool call ``call`` (``AppendToolResult``); content that
        is not a string is sent as JSON."""
        call_id = call.id if isinstance(call, ToolCall) else int(call)
        if not isinstance(content, str):
            content = json.dumps(content)
        return self._committed("AppendToolResult", {"call_id": call_id, "content": content})

    def open_tool_calls(self) -> List[ToolCall]:
        """The calls the model made that are not answered yet (``OpenToolCalls``)."""
        calls = self.client._expect("ToolCalls", "OpenToolCalls", {"session": self.id})["calls"]
        return [ToolCall(c[0], c[1], c[2]) for c in calls]

    # -- scheduling -------------------------------------------------------

    def pin(self, ttl_s: float) -> int:
        """Holds the session's prefix in cache for ``ttl_s`` seconds (0
        clears); returns the deadline in unix milliseconds (``Pin``)."""
        return self.client._expect("Pinned", "Pin", {"session": self.id, "ttl_ms": int(ttl_s * 1000)})["deadline_unix_ms"]

    def set_qos(self, class_: int, batch_invariant: bool = False) -> Event:
        """Sets the scheduling class, 0 to 3 (``SetQos``)."""
        return self._committed("SetQos", {"class": int(class_), "batch_invariant": bool(batch_invariant)})
