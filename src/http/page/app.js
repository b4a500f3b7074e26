// superfluid's page: the session tree, one session's log, and the actions
// on it, over /web/ws only (docs/web.md, "The page"). No build step: this
// file is served as written. Sections, in order:
//
//   1. helpers      small DOM and text helpers
//   2. Conn         one WebSocket: requests answered in order, Sub* frames
//                   routed to their subscription
//   3. state        what the page knows
//   4. connection   connecting, reconnecting, a refused token
//   5. status       the strip from Metrics
//   6. tree         Sessions + Tree, polled; one node per session
//   7. session      the selected session's events, live (Subscribe with
//                   provisional text), folded into items
//   8. actions      new, send, generate, cancel, fork, edit, trim, pin,
//                   archive, rename, purge
//   9. keyboard and start

// ---- 1. helpers -------------------------------------------------------------

const $ = (id) => document.getElementById(id);

/** An element with attributes (`on*` are listeners) and children. */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const ROLES = ["system", "user", "assistant", "tool"];
const FINISH = ["open", "end of turn", "max tokens", "grammar", "cancelled", "error"];
const CHANNELS = ["text", "reasoning", "tool call"];

function short(text, n = 60) {
  const one = (text || "").replace(/\s+/g, " ").trim();
  return one.length > n ? one.slice(0, n - 1) + "…" : one;
}

function ago(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 45) return "just now";
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(ms).toLocaleDateString();
}

/** A record's name and fields: `{"Message": {...}}` or `"EpochBump"`. */
function kindOf(body) {
  if (typeof body === "string") return [body, {}];
  const kind = Object.keys(body)[0];
  return [kind, body[kind]];
}

function banner(text, kind = "error") {
  const b = $("banner");
  b.replaceChildren();
  if (!text) {
    b.hidden = true;
    return;
  }
  b.className = `banner ${kind}`;
  b.append(text instanceof Node ? text : String(text));
  b.hidden = false;
}

function toast(text) {
  banner(el("span", {}, text, " ", el("button", { class: "link", onclick: () => banner(null) }, "dismiss")));
}

// ---- 2. Conn ------------------------------------------------------------------

/** One WebSocket to /web/ws. `call` sends a request and resolves with its
 *  reply (replies come in request order); `Sub*` frames go to the handler
 *  registered for their `sub`. A Generate's `Delta` frames go to `onDelta`
 *  of the call that asked. */
class Conn {
  constructor(token) {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/web/ws`;
    this.ws = new WebSocket(url, ["superfluid.v1", `superfluid.token.${token}`]);
    this.pending = [];
    this.subs = new Map();
    this.opened = new Promise((resolve, reject) => {
      this.ws.onopen = () => resolve(this);
      this.ws.onerror = () => reject(new Error("the WebSocket was refused"));
    });
    this.closed = new Promise((resolve) => {
      this.ws.onclose = (e) => {
        for (const p of this.pending) p.reject(new Error("the connection closed"));
        this.pending = [];
        for (const handler of this.subs.values()) handler({ SubEnded: { reason: "connection closed" } });
        this.subs.clear();
        resolve(e);
      };
    });
    this.ws.onmessage = ({ data }) => this.receive(JSON.parse(data));
  }

  receive(reply) {
    const [kind, fields] = kindOf(reply);
    if (kind === "SubEvent" || kind === "SubProvisional" || kind === "SubEnded") {
      const handler = this.subs.get(fields.sub);
      if (handler) handler(reply);
      if (kind === "SubEnded") this.subs.delete(fields.sub);
      return;
    }
    const head = this.pending[0];
    if (!head) return;
    if (kind === "Delta") {
      if (head.onDelta) head.onDelta(fields.event);
      return;
    }
    this.pending.shift();
    if (kind === "Err") head.reject(new Error(fields.message));
    else head.resolve(reply);
  }

  /** Sends `request`; resolves with the reply's fields, or rejects with
   *  an `Err`'s message. `expect` names the reply variant wanted. */
  call(request, expect, onDelta) {
    return new Promise((resolve, reject) => {
      if (this.ws.readyState !== WebSocket.OPEN) {
        reject(new Error("not connected"));
        return;
      }
      this.pending.push({
        onDelta,
        reject,
        resolve: (reply) => {
          const [kind, fields] = kindOf(reply);
          if (expect && kind !== expect) reject(new Error(`expected ${expect}, got ${kind}`));
          else resolve(fields);
        },
      });
      this.ws.send(JSON.stringify(request));
    });
  }

  async subscribe(session, cursor, handler) {
    const { sub } = await this.call({ Subscribe: { session, cursor, provisional: true } }, "Subscribed");
    this.subs.set(sub, handler);
    return sub;
  }

  close() {
    this.ws.close();
  }
}

// ---- 3. state ---------------------------------------------------------------

const state = {
  token: null,
  conn: null, // the Conn for requests and subscriptions
  connected: false,
  /** id -> { summary, forkAt, kind ("Created" | "Forked" | "Rebased"),
   *  label (first user words), cursor (next event to read for them) } */
  sessions: new Map(),
  treeSignature: "",
  showArchived: false,
  selected: null, // session id
  sub: null, // its subscription
  events: [], // its events, in order
  provisional: ["", "", ""], // text ahead of its commit, by channel
  inspection: null,
  generating: new Set(), // sessions this page is generating on
  /** "session:event id" of a turn's last Delta -> the Generated summary */
  turnStats: new Map(),
  openDetails: new Set(), // keys of reasoning blocks the user unfolded
  items: new Map(), // key -> { sig, node } of the rendered events
  pins: new Map(), // session -> deadline (ms)
};

// ---- 4. connection --------------------------------------------------------------

function tokenFromHash() {
  const m = /(?:^#|&)token=([0-9a-fA-F]+)/.exec(location.hash);
  return m ? m[1] : null;
}

function setConn(text, kind) {
  const c = $("conn");
  c.textContent = text;
  c.className = `conn ${kind}`;
}

let reconnectTimer = null;
let connectAttempt = 0;

async function connect() {
  clearTimeout(reconnectTimer);
  state.token = tokenFromHash();
  if (!state.token) {
    setConn("no token", "bad");
    askForToken("This page needs the daemon's token in its address (…/web/#token=…).");
    return;
  }
  setConn(connectAttempt ? "reconnecting…" : "connecting…", "wait");
  const conn = new Conn(state.token);
  try {
    await conn.opened;
  } catch {
    await refused();
    return;
  }
  connectAttempt = 0;
  state.conn = conn;
  state.connected = true;
  setConn("connected", "ok");
  banner(null);
  conn.closed.then(() => {
    if (state.conn !== conn) return;
    state.connected = false;
    state.conn = null;
    state.sub = null;
    setConn("disconnected: retrying", "bad");
    scheduleReconnect();
  });
  await refreshTree();
  if (state.selected !== null) await select(state.selected, { keepEvents: true });
  refreshStatus();
}

/** The WebSocket did not open: the daemon is down (retry) or it refused
 *  the token (say so: a restart mints a new one). */
async function refused() {
  let up = false;
  try {
    const r = await fetch("/web/health", { cache: "no-store" });
    up = r.ok;
  } catch {
    up = false;
  }
  if (up) {
    setConn("token refused", "bad");
    askForToken(
      "The daemon refused this page's token. It mints a new token at every start: " +
        "run `superfluid open` and use the link it prints, or paste it here.",
    );
  } else {
    setConn("daemon unreachable: retrying", "bad");
    scheduleReconnect();
  }
}

function scheduleReconnect() {
  connectAttempt += 1;
  const delay = Math.min(5000, 250 * 2 ** Math.min(connectAttempt, 5));
  clearTimeout(reconnectTimer);
  reconnectTimer = setTimeout(connect, delay);
}

function askForToken(text) {
  const input = el("input", {
    id: "token-input",
    type: "text",
    placeholder: "http://…/web/#token=… or the token",
    "aria-label": "Link or token",
    autocomplete: "off",
  });
  const use = () => {
    const value = input.value.trim();
    const m = /token=([0-9a-fA-F]+)/.exec(value) || /^([0-9a-fA-F]+)$/.exec(value);
    if (!m) return;
    connectAttempt = 0;
    history.replaceState(null, "", `#token=${m[1]}`);
    connect();
  };
  input.addEventListener("keydown", (e) => e.key === "Enter" && use());
  banner(
    el(
      "div",
      { class: "token-form" },
      el("p", { id: "token-message" }, text),
      input,
      el("button", { class: "primary", onclick: use }, "Connect"),
    ),
  );
}

/** `call` on the connection, with a visible message when it fails. */
async function call(request, expect) {
  if (!state.conn) throw new Error("not connected to the daemon");
  return state.conn.call(request, expect);
}

async function act(what, fn) {
  try {
    return await fn();
  } catch (e) {
    toast(`${what}: ${e.message}`);
    return undefined;
  }
}

// ---- 5. status ----------------------------------------------------------------

let lastCounters = null;

function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    values[line.slice(0, space)] = Number(line.slice(space + 1));
  }
  return values;
}

async function refreshStatus() {
  if (!state.connected) return;
  let text;
  try {
    ({ text } = await call("Metrics", "Text"));
  } catch {
    return;
  }
  const m = parseMetrics(text);
  const lane =
    ["ready", "loading", "respawning"].find((s) => m[`superfluid_lane_state{state="${s}"}`] === 1) || "?";
  const now = performance.now();
  const generated = m.superfluid_generated_tokens_total || 0;
  let rate = null;
  if (lastCounters && now > lastCounters.at) {
    rate = ((generated - lastCounters.generated) * 1000) / (now - lastCounters.at);
  }
  lastCounters = { at: now, generated };
  const model = document.querySelector('meta[name="superfluid-model"]').content;
  const item = (label, value, title) =>
    el("span", { class: "stat", title }, el("span", { class: "stat-label" }, label), " ", el("b", {}, value));
  $("status").replaceChildren(
    $("conn"),
    item("model", model),
    item("lane", lane, "the model worker: loading, ready or respawning"),
    item("tok/s", rate === null ? "–" : rate.toFixed(1), "tokens drawn per second, over the last 2 s"),
    item("KV", String(m.superfluid_kv_cells_used ?? "?"), "KV cells in use"),
    item("sessions", String(m.superfluid_sessions ?? "?")),
    item("subs", String(m.superfluid_subscribers ?? "?"), "live subscriptions"),
  );
  $("status").dataset.lane = lane;
}

// ---- 6. tree ----------------------------------------------------------------------

async function refreshTree() {
  if (!state.connected) return;
  let list, tree;
  try {
    [list, tree] = await Promise.all([
      call({ Sessions: { include_archived: true } }, "SessionList"),
      call("Tree", "Tree"),
    ]);
  } catch {
    return;
  }
  const forkAt = new Map(tree.nodes.map(([id, , at]) => [id, at]));
  const seen = new Set();
  for (const summary of list.sessions) {
    seen.add(summary.session);
    let info = state.sessions.get(summary.session);
    if (!info) {
      const at = forkAt.get(summary.session);
      info = { kind: summary.parent === null ? "Created" : null, label: null, cursor: at ?? 0 };
      state.sessions.set(summary.session, info);
    }
    info.summary = summary;
    info.forkAt = forkAt.get(summary.session) ?? null;
    if ((info.label === null || info.kind === null) && info.cursor < summary.events) {
      await learn(summary.session, info);
    }
  }
  for (const id of [...state.sessions.keys()]) if (!seen.has(id)) state.sessions.delete(id);
  renderTree();
}

/** Reads a session's own events (from where it branched) once, for the
 *  branch record and its first user words. */
async function learn(id, info) {
  let events;
  try {
    ({ events } = await call({ Read: { session: id, cursor: info.cursor } }, "Events"));
  } catch {
    return;
  }
  for (const e of events) {
    const [kind, f] = kindOf(e.body);
    if (kind === "Forked" || kind === "Rebased") {
      // The last branch record read is the session's own (read from 0, a
      // fork of a fork shows its parent's first); a root stays "Created".
      if (info.kind !== "Created") info.kind = kind;
      // Read from 0 (Tree leaves archived sessions out, and a rerooted one
      // has no parent there): the words before the branch are the parent's.
      info.branchedAt = f.fork_at;
      info.label = null;
    }
    if (kind === "Rebased") info.edits = f.edits;
    if (info.label === null && kind === "Message" && f.role === 1) info.label = short(f.text, 48);
    info.cursor = e.event_id + 1;
  }
  if (info.kind === null) info.kind = "Created";
}

function edgeLabel(info) {
  const at = info.forkAt ?? info.branchedAt;
  if (info.kind === "Rebased") return el("span", { class: "edge edge-rebase" }, `edit at event ${at}`);
  if (info.kind === "Forked") return el("span", { class: "edge edge-fork" }, `fork at event ${at}`);
  return el("span", { class: "edge" }, "created under");
}

/** A session's name: its title, else its first own user words. */
function nameOf(id) {
  const info = state.sessions.get(id);
  const name = info?.summary.title || info?.label;
  return name ? `#${id} “${short(name, 24)}”` : `#${id}`;
}

function renderTree() {
  const visible = [...state.sessions.values()].filter((i) => state.showArchived || !i.summary.archived);
  const signature = JSON.stringify([
    state.selected,
    [...state.generating],
    visible.map((i) => [i.summary, i.label, i.kind, i.forkAt, state.pins.get(i.summary.session)]),
    Math.floor(Date.now() / 30000),
  ]);
  if (signature === state.treeSignature) return;
  state.treeSignature = signature;
  const byParent = new Map();
  const ids = new Set(visible.map((i) => i.summary.session));
  for (const info of visible) {
    const parent = ids.has(info.summary.parent) ? info.summary.parent : null;
    if (!byParent.has(parent)) byParent.set(parent, []);
    byParent.get(parent).push(info);
  }
  const focused = document.activeElement?.dataset?.session;
  const branch = (parent, depth) => {
    const children = byParent.get(parent) || [];
    children.sort((a, b) => a.summary.session - b.summary.session);
    return children.map((info) => {
      const s = info.summary;
      const kids = branch(s.session, depth + 1);
      const title = short(s.title, 80) || info.label || (s.parent === null ? "(no messages yet)" : `branch of ${nameOf(s.parent)}`);
      const node = el(
        "button",
        {
          class: `node${s.session === state.selected ? " selected" : ""}${s.archived ? " archived" : ""}`,
          role: "treeitem",
          "aria-selected": String(s.session === state.selected),
          "aria-level": String(depth + 1),
          dataset: { session: String(s.session) },
          onclick: () => select(s.session),
        },
        s.parent !== null ? edgeLabel(info) : null,
        el("span", { class: "node-title" }, el("span", { class: "node-id" }, `#${s.session}`), " ", title),
        el(
          "span",
          { class: "node-meta" },
          `${s.events} events · ${ago(s.updated_unix_ms)}`,
          state.generating.has(s.session) ? el("span", { class: "badge live" }, "generating") : null,
          state.pins.get(s.session) > Date.now() ? el("span", { class: "badge" }, "pinned") : null,
          s.archived ? el("span", { class: "badge" }, "archived") : null,
        ),
      );
      return el("li", { class: "tree-item" }, node, kids.length ? el("ul", { role: "group" }, kids) : null);
    });
  };
  const roots = branch(null, 0);
  $("tree").replaceChildren(...roots);
  $("tree-empty").hidden = roots.length > 0;
  if (focused) document.querySelector(`#tree [data-session="${focused}"]`)?.focus();
}

// ---- 7. session -----------------------------------------------------------------

/** Counts select() calls: a Subscribe answered after a later select() is
 *  nobody's, and is ended at once (quick switches leaked one each, until
 *  the connection's 64 were taken). */
let selectSeq = 0;

async function select(id, { keepEvents = false } = {}) {
  const seq = ++selectSeq;
  const changed = state.selected !== id;
  if (state.sub !== null && state.conn) {
    const sub = state.sub;
    state.sub = null;
    state.conn.subs.delete(sub);
    state.conn.call({ Unsubscribe: { sub } }).catch(() => {});
  }
  state.selected = id;
  if (changed || !keepEvents) {
    state.events = [];
    state.provisional = ["", "", ""];
    state.items.clear();
    $("events").replaceChildren();
  }
  document.body.classList.add("has-session");
  $("session").hidden = false;
  $("placeholder").hidden = true;
  renderHead();
  renderTree();
  if (!state.conn) return;
  const cursor = state.events.length ? state.events[state.events.length - 1].event_id + 1 : 0;
  const conn = state.conn;
  try {
    const sub = await conn.subscribe(id, cursor, (reply) => onSub(id, reply));
    if (seq !== selectSeq) {
      conn.subs.delete(sub);
      conn.call({ Unsubscribe: { sub } }).catch(() => {});
      return;
    }
    state.sub = sub;
  } catch (e) {
    if (seq === selectSeq) toast(`session #${id}: ${e.message}`);
  }
  inspect();
  if (changed) $("message").focus();
}

function deselect() {
  document.body.classList.remove("has-session");
  $("tree").querySelector(".selected")?.focus();
}

let renderQueued = false;
function queueRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    renderEvents();
  });
}

function onSub(id, reply) {
  if (state.selected !== id) return;
  const [kind, f] = kindOf(reply);
  if (kind === "SubEvent") {
    const last = state.events[state.events.length - 1];
    if (last && f.event.event_id <= last.event_id) return;
    state.events.push(f.event);
    const [rec, body] = kindOf(f.event.body);
    if (rec === "Generated") {
      const p = state.provisional[body.channel] || "";
      state.provisional[body.channel] = p.startsWith(body.text) ? p.slice(body.text.length) : "";
      if (body.finish !== 0) state.provisional = ["", "", ""];
    } else if (rec === "ToolUse") {
      state.provisional[2] = "";
    }
    queueRender();
    queueInspect();
  } else if (kind === "SubProvisional") {
    state.provisional[f.channel] += f.text;
    queueRender();
  } else if (kind === "SubEnded") {
    if (f.reason === "purged") {
      toast(`session #${id} was purged`);
      state.selected = null;
      document.body.classList.remove("has-session");
      $("session").hidden = true;
      $("placeholder").hidden = false;
      refreshTree();
    } else if (f.reason === "lagged" && state.conn) {
      select(id, { keepEvents: true });
    }
  }
}

let inspectTimer = null;
function queueInspect() {
  clearTimeout(inspectTimer);
  inspectTimer = setTimeout(inspect, 300);
}

async function inspect() {
  const id = state.selected;
  if (id === null || !state.connected) return;
  try {
    const { inspection } = await call({ Inspect: { session: id } }, "Inspection");
    if (state.selected !== id) return;
    state.inspection = inspection;
  } catch {
    return;
  }
  renderHead();
  renderEvents();
}

function renderHead() {
  const info = state.sessions.get(state.selected);
  const i = state.inspection && state.inspection.session === state.selected ? state.inspection : null;
  const title = short(i?.title || info?.summary.title, 120) || info?.label || "untitled";
  $("session-title").replaceChildren(el("span", { class: "node-id" }, `#${state.selected}`), " ", title);
  const generating = state.generating.has(state.selected) || !!i?.generating;
  $("cancel").hidden = !generating;
  $("send").disabled = generating;
  $("generate").disabled = generating;
  $("archive").textContent = i?.archived ? "Unarchive" : "Archive";
  const pinned = state.pins.get(state.selected) > Date.now();
  $("pin").textContent = pinned ? "Unpin" : "Pin";
  if (!i) return;
  const p = i.params;
  $("meta-summary").textContent =
    `${i.events} events · ${i.tokens} tokens · ` +
    (i.parent !== null ? `from #${i.parent} at #${i.fork_at}` : "root") +
    (i.archived ? " · archived" : "");
  const row = (k, v) => [el("dt", {}, k), el("dd", {}, v)];
  $("meta").replaceChildren(
    ...row("sampling", `temperature ${p.temperature}, top_p ${p.top_p}, min_p ${p.min_p}, top_k ${p.top_k}, seed ${p.seed}`),
    ...row("created", new Date(i.created_unix_ms).toLocaleString()),
    ...row("updated", new Date(i.updated_unix_ms).toLocaleString()),
    ...row("branches", i.children.length ? i.children.map((c) => `#${c}`).join(", ") : "none"),
    ...row("version / generation", `${i.version} / ${i.generation}`),
    ...row("open turn", i.open_turn ? "yes (Generate continues it)" : "no"),
    ...row("pinned", pinned ? `until ${new Date(state.pins.get(state.selected)).toLocaleTimeString()}` : "no"),
  );
}

/** The log folded into what a reader wants: messages, assistant turns
 *  (reasoning, text, tool calls), tool results, permission requests, and
 *  small lines for the rest. Each item knows its first and last event. */
function foldEvents(events) {
  const items = [];
  let turn = null;
  const answered = new Map();
  for (const e of events) {
    const [kind, f] = kindOf(e.body);
    if (kind === "PermissionResponded") answered.set(f.request_id, f.granted);
  }
  const item = (type, e, extra) => {
    const it = { type, key: `${type}:${e.event_id}`, first: e.event_id, last: e.event_id, ...extra };
    items.push(it);
    return it;
  };
  for (const e of events) {
    const [kind, f] = kindOf(e.body);
    if (kind === "GenerationPrompt") {
      turn = item("turn", e, { parts: [], tokens: 0, finish: 0, ids: [] });
      continue;
    }
    if (turn && (kind === "Generated" || kind === "ToolUse" || kind === "ToolParseFailure")) {
      turn.last = e.event_id;
      turn.ids.push(e.event_id);
      if (kind === "Generated") {
        turn.tokens += f.span.length;
        const tail = turn.parts[turn.parts.length - 1];
        if (tail && tail.type === "text" && tail.channel === f.channel) tail.text += f.text;
        else turn.parts.push({ type: "text", channel: f.channel, text: f.text, key: `${turn.key}:${e.event_id}` });
        if (f.finish !== 0) {
          turn.finish = f.finish;
          turn = null;
        }
      } else if (kind === "ToolUse") {
        turn.parts.push({ type: "call", id: e.event_id, name: f.name, arguments: f.arguments });
      } else {
        turn.parts.push({ type: "parse-failure", text: f.text, error: f.error });
      }
      continue;
    }
    turn = kind === "Generated" || kind === "ToolUse" ? turn : null;
    switch (kind) {
      case "Created":
      case "Forked":
      case "Rebased":
        item("branch", e, { kind, f });
        break;
      case "Message":
        item("message", e, { role: f.role, text: f.text });
        break;
      case "System":
        item("message", e, { role: 0, text: f.text || "", tools: f.tools });
        break;
      case "Generated": // a turn without its prompt (should not happen)
        item("message", e, { role: 2, text: f.text });
        break;
      case "ToolUse":
        item("note", e, { text: `tool call ${f.name}(${f.arguments})` });
        break;
      case "ToolResult":
        item("tool-result", e, { call: f.call_id, text: f.content });
        break;
      case "ToolOutcome":
        item("note", e, {
          text: `tool call #${f.call_id} ${["", "failed", "cancelled"][f.outcome] || `outcome ${f.outcome}`}` +
            (f.note ? `: ${f.note}` : ""),
        });
        break;
      case "ToolCancelRequested":
        item("note", e, { text: `cancel requested for tool call #${f.call_id}` });
        break;
      case "PermissionRequested":
        item("permission", e, { call: f.call_id, text: f.text, granted: answered.get(e.event_id) });
        break;
      case "PermissionResponded":
        item("note", e, { text: `permission #${f.request_id} ${f.granted ? "granted" : "denied"}` });
        break;
      case "Appended":
        item("message", e, { role: -1, text: f.text });
        break;
      case "EpochBump":
        item("note", e, { text: "the daemon restarted" });
        break;
      case "Qos":
        item("note", e, { text: `QoS class ${f.class}${f.batch_invariant ? ", batch invariant" : ""}` });
        break;
      case "ToolChoice":
        item("note", e, { text: `tool choice: ${f.choice}` });
        break;
      case "OutputFormat":
        item("note", e, { text: f.schema ? "output format: JSON schema" : "output format: text" });
        break;
      case "Image":
        item("note", e, { text: `${ROLES[f.role] || "?"}: image ${short(f.blob, 16)}` });
        break;
      case "Block":
        item("message", e, { role: f.role, text: `[${f.kind}] ${f.payload}` });
        break;
      case "ToolParseFailure":
        item("note", e, { text: `tool call not parsed: ${f.error}` });
        break;
      default:
        item("note", e, { text: kind });
    }
  }
  return items;
}

function eventRange(it) {
  return it.first === it.last ? `#${it.first}` : `#${it.first}–${it.last}`;
}

/** The buttons every item has: fork after it, trim from it, and edit for
 *  messages and finished turns. */
function itemActions(it, text) {
  const editable = (it.type === "message" && it.role >= 0 && it.role !== 0 && it.first > 0) ||
    (it.type === "turn" && it.finish !== 0);
  return el(
    "span",
    { class: "actions" },
    el("span", { class: "event-id", title: "event ids" }, eventRange(it)),
    el("button", {
      class: "small",
      title: `New branch holding everything up to event ${it.last}`,
      "aria-label": `fork after event ${it.last}`,
      onclick: () => fork(it.last + 1),
    }, "fork"),
    editable
      ? el("button", {
        class: "small",
        title: "New branch with this message replaced",
        "aria-label": `edit event ${it.first}`,
        onclick: () => editMessage(it, text),
      }, "edit")
      : null,
    it.first > 0
      ? el("button", {
        class: "small",
        title: `New branch without event ${it.first} and what follows`,
        "aria-label": `trim from event ${it.first}`,
        onclick: () => trim(it.first),
      }, "trim")
      : null,
  );
}

function turnText(it) {
  return it.parts.filter((p) => p.type === "text" && p.channel === 0).map((p) => p.text).join("");
}

function stats(it) {
  for (let k = it.ids.length - 1; k >= 0; k--) {
    const s = state.turnStats.get(`${state.selected}:${it.ids[k]}`);
    if (s) return s;
  }
  return null;
}

function renderItem(it, live) {
  switch (it.type) {
    case "branch": {
      const { kind, f } = it;
      const text = kind === "Created"
        ? (f.parent !== null && f.parent !== undefined ? `created under #${f.parent}` : "created")
        : kind === "Forked"
          ? `forked from #${f.parent} at event ${f.fork_at}`
          : `edited from #${f.parent} at event ${f.fork_at} (${f.edits.length} edit${f.edits.length === 1 ? "" : "s"})`;
      return el("li", { class: `item branch-line ${kind.toLowerCase()}` },
        el("span", { class: "event-id" }, `#${it.first}`), " ", text,
        kind !== "Created" ? el("button", { class: "link", onclick: () => select(f.parent) }, `open #${f.parent}`) : null);
    }
    case "message": {
      const role = it.role === -1 ? "raw" : ROLES[it.role] || `role ${it.role}`;
      return el("li", { class: `item message role-${role}` },
        el("div", { class: "item-head" }, el("span", { class: "role" }, role), itemActions(it, it.text)),
        el("div", { class: "text" }, it.text || el("i", {}, "(empty)")),
        it.tools && it.tools.length
          ? el("details", { class: "tools" }, el("summary", {}, `${it.tools.length} tool${it.tools.length === 1 ? "" : "s"} declared`),
            el("pre", {}, it.tools.join("\n")))
          : null);
    }
    case "turn": {
      const s = stats(it);
      // The model's raw tool-call text says again what the parsed call says.
      const parsed = it.parts.some((p) => p.type === "call");
      const shown = it.parts.filter((p) =>
        p.type !== "text" || (p.text.trim() !== "" && !(p.channel === 2 && parsed)));
      const parts = shown.map((p) => {
        if (p.type === "call") {
          return el("div", { class: "call" }, el("span", { class: "call-label" }, `tool call #${p.id}`), " ",
            el("code", {}, `${p.name}(${p.arguments})`));
        }
        if (p.type === "parse-failure") return el("div", { class: "call failed" }, `tool call not parsed: ${p.error}`);
        if (p.channel === 1) {
          const d = el("details", { class: "reasoning" }, el("summary", {}, `reasoning (${p.text.length} chars)`),
            el("div", { class: "text" }, p.text));
          // Unfolded while it streams, folded once the turn is done.
          d.open = live || state.openDetails.has(p.key);
          // Remember what the reader unfolds (not what streaming unfolded).
          if (!live) d.addEventListener("toggle", () => d.open ? state.openDetails.add(p.key) : state.openDetails.delete(p.key));
          return d;
        }
        if (p.channel === 2) return el("div", { class: "call pending" }, el("code", {}, p.text));
        return el("div", { class: "text" }, p.text);
      });
      if (live) {
        const [text, reasoning, callText] = state.provisional;
        if (reasoning) parts.push(el("div", { class: "text provisional reasoning-live" }, reasoning));
        if (callText) parts.push(el("div", { class: "call provisional" }, el("code", {}, callText)));
        if (text) parts.push(el("div", { class: "text provisional" }, text));
        if (!reasoning && !callText && !text && it.parts.length === 0) parts.push(el("div", { class: "text provisional" }, "…"));
      }
      const foot = it.finish === 0
        ? (live ? "generating…" : `${it.tokens} tokens · open (Generate continues it)`)
        : `${it.tokens} tokens · ${FINISH[it.finish] || it.finish}` + (s ? ` · warm prefix ${s.warm_prefix}` : "");
      return el("li", { class: `item message role-assistant turn${live ? " live" : ""}` },
        el("div", { class: "item-head" }, el("span", { class: "role" }, "assistant"), itemActions(it, turnText(it))),
        parts,
        el("div", { class: "turn-foot" }, foot));
    }
    case "tool-result":
      return el("li", { class: "item message role-tool" },
        el("div", { class: "item-head" }, el("span", { class: "role" }, `tool result for #${it.call}`), itemActions(it, it.text)),
        el("pre", { class: "text" }, it.text));
    case "permission": {
      const answered = it.granted !== undefined;
      return el("li", { class: "item permission" },
        el("div", { class: "item-head" }, el("span", { class: "role" }, `permission for tool call #${it.call}`), itemActions(it, it.text)),
        el("div", { class: "text" }, it.text),
        answered
          ? el("div", { class: `answer ${it.granted ? "granted" : "denied"}` }, it.granted ? "granted" : "denied")
          : el("div", { class: "answer" },
            el("button", { class: "primary", onclick: () => respond(it.first, true) }, "Grant"),
            el("button", { class: "danger", onclick: () => respond(it.first, false) }, "Deny")));
    }
    case "shared":
      return el("li", { class: "item shared-line" },
        el("span", {}, `▲ events 0–${it.first - 1} are shared with ${nameOf(it.parent)}; this branch's own events follow`));
    default:
      return el("li", { class: "item note" }, el("span", { class: "event-id" }, `#${it.first}`), " ", it.text);
  }
}

/** A long text in an item's signature: its length and ends. Committed
 *  text never changes, and a live turn's grows, so this tells them apart
 *  without writing out a long message at every update (a 1 MB message
 *  cost about 350 ms a token while a turn streamed). */
function sigText(_key, value) {
  return typeof value === "string" && value.length > 256
    ? `${value.length}:${value.slice(0, 64)}:${value.slice(-64)}`
    : value;
}

function renderEvents() {
  const list = $("events");
  const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  const items = foldEvents(state.events);
  const generating = state.generating.has(state.selected) || !!state.inspection?.generating;
  const hasProvisional = state.provisional.some((t) => t);
  let liveKey = null;
  const lastTurn = [...items].reverse().find((it) => it.type === "turn");
  if ((generating || hasProvisional) && lastTurn && lastTurn.finish === 0) liveKey = lastTurn.key;
  else if (hasProvisional) {
    items.push({ type: "turn", key: "live", first: 0, last: 0, parts: [], tokens: 0, finish: 0, ids: [] });
    liveKey = "live";
  }
  // A branch's events before its fork point are its parent's, shared.
  const forkAt = state.inspection?.session === state.selected ? state.inspection.fork_at : null;
  if (forkAt !== null && forkAt > 0) {
    const k = items.findIndex((it) => it.first >= forkAt);
    items.splice(k < 0 ? items.length : k, 0, {
      type: "shared", key: `shared:${forkAt}`, first: forkAt, last: forkAt, parent: state.inspection.parent,
    });
  }
  let shared = forkAt !== null && forkAt > 0;
  const keep = new Map();
  const nodes = items.map((it) => {
    if (it.type === "shared") shared = false;
    const live = it.key === liveKey;
    const s = it.type === "turn" ? stats(it) : null;
    const sig = JSON.stringify([it, live && state.provisional, s], sigText);
    const old = state.items.get(it.key);
    const node = old && old.sig === sig ? old.node : renderItem(it, live);
    node.classList.toggle("inherited", shared);
    keep.set(it.key, { sig, node });
    return node;
  });
  state.items = keep;
  const current = [...list.children];
  if (current.length !== nodes.length || nodes.some((n, k) => current[k] !== n)) {
    const focused = document.activeElement;
    list.replaceChildren(...nodes);
    if (focused && list.contains(focused) === false && document.body.contains(focused)) focused.focus();
  }
  if (nearBottom) list.scrollTop = list.scrollHeight;
  renderHead();
}

// ---- 8. actions ---------------------------------------------------------------------

function numberOf(id) {
  const v = Number($(id).value);
  if (!Number.isFinite(v)) throw new Error(`${id.replace("new-", "")} is not a number`);
  return v;
}

async function createSession() {
  $("new-error").textContent = "";
  let params, tools;
  try {
    params = {
      temperature: numberOf("new-temperature"),
      top_p: numberOf("new-top-p"),
      min_p: numberOf("new-min-p"),
      top_k: Math.trunc(numberOf("new-top-k")),
      seed: Math.trunc(numberOf("new-seed")),
    };
    const raw = $("new-tools").value.trim();
    tools = raw ? JSON.parse(raw) : [];
    if (!Array.isArray(tools)) throw new Error("tools must be a JSON array");
  } catch (e) {
    $("new-error").textContent = e.message;
    return false;
  }
  const system = $("new-system").value.trim();
  try {
    const { session } = await call({ Create: { parent: null, params } }, "Created");
    if (system || tools.length) {
      await call({
        AppendSystem: { session, text: system || null, tools: tools.map((t) => JSON.stringify(t)) },
      }, "Committed");
    }
    await refreshTree();
    await select(session);
    return true;
  } catch (e) {
    $("new-error").textContent = e.message;
    return false;
  }
}

function nextEventId() {
  return state.inspection?.session === state.selected
    ? Math.max(state.inspection.events, state.events.length)
    : state.events.length;
}

async function send() {
  const text = $("message").value;
  const role = Number($("role").value);
  const id = state.selected;
  if (id === null || !text.trim()) return;
  const ok = await act("send", () => call({ AppendMessage: { session: id, role, text } }, "Committed"));
  if (!ok) return;
  $("message").value = "";
  if (role === 1) await generate();
}

/** A Generate on a connection of its own: /web/ws runs one request at a
 *  time per connection, and the tree, the status and Cancel must go on. */
async function generate() {
  const id = state.selected;
  if (id === null || state.generating.has(id)) return;
  const maxTokens = Math.max(1, Number($("max-tokens").value) || 256);
  state.generating.add(id);
  renderHead();
  renderTree();
  queueRender();
  const conn = new Conn(state.token);
  let lastDelta = null;
  try {
    await conn.opened;
    const summary = await conn.call({ Generate: { session: id, max_tokens: maxTokens } }, "Generated",
      (event) => { lastDelta = event.event_id; });
    if (lastDelta !== null) state.turnStats.set(`${id}:${lastDelta}`, summary);
  } catch (e) {
    toast(`generate on #${id}: ${e.message}`);
  } finally {
    conn.close();
    state.generating.delete(id);
    if (state.selected === id) {
      state.provisional = ["", "", ""];
      await inspect();
    }
    renderHead();
    renderTree();
    refreshTree();
  }
}

async function cancel() {
  const id = state.selected;
  await act("cancel", () => call({ Cancel: { session: id } }, "Cancelling"));
}

async function fork(atEvent) {
  const { session } = (await act("fork", () =>
    call({ Fork: { session: state.selected, at_event: atEvent, params: null } }, "Created"))) || {};
  if (session === undefined) return;
  await refreshTree();
  await select(session);
}

async function trim(toEvent) {
  const { session } = (await act("trim", () =>
    call({ Trim: { session: state.selected, to_event: toEvent } }, "Created"))) || {};
  if (session === undefined) return;
  await refreshTree();
  await select(session);
}

let editing = null;
function editMessage(it, text) {
  editing = it;
  $("edit-text").value = text;
  $("edit-title").textContent = `Edit event #${it.first}`;
  $("edit-dialog").showModal();
  $("edit-text").focus();
}

async function saveEdit() {
  const it = editing;
  if (!it) return;
  const role = it.type === "turn" ? 2 : it.role;
  const edit = { Replace: { from: it.first, to: nextEventId(), role, text: $("edit-text").value } };
  const { session } = (await act("edit", () =>
    call({ Rebase: { session: state.selected, edits: [edit], params: null } }, "Created"))) || {};
  if (session === undefined) return;
  await refreshTree();
  await select(session);
}

async function respond(requestId, granted) {
  await act("permission", () =>
    call({ RespondPermission: { session: state.selected, request_id: requestId, granted } }, "Committed"));
}

async function togglePin() {
  const id = state.selected;
  const pinned = state.pins.get(id) > Date.now();
  const reply = await act("pin", () => call({ Pin: { session: id, ttl_ms: pinned ? 0 : 600000 } }, "Pinned"));
  if (!reply) return;
  if (pinned) state.pins.delete(id);
  else state.pins.set(id, reply.deadline_unix_ms);
  renderHead();
  renderTree();
}

async function setMeta(change) {
  const id = state.selected;
  await act("meta", async () => {
    const { inspection } = await call({ Inspect: { session: id } }, "Inspection");
    await call({
      SetMeta: { session: id, expected_version: inspection.version, title: null, archived: null, ...change },
    }, "Meta");
  });
  await inspect();
  await refreshTree();
}

async function purge(mode) {
  const id = state.selected;
  const reply = await act("purge", async () => {
    const { inspection } = await call({ Inspect: { session: id } }, "Inspection");
    return call({ Purge: { session: id, expected_generation: inspection.generation, mode } }, "Purged");
  });
  if (!reply) return;
  state.selected = null;
  document.body.classList.remove("has-session");
  $("session").hidden = true;
  $("placeholder").hidden = false;
  await refreshTree();
}

// ---- 9. keyboard and start ------------------------------------------------------------

function wire() {
  $("new-session").addEventListener("click", () => {
    $("new-error").textContent = "";
    $("new-dialog").showModal();
  });
  $("new-form").addEventListener("submit", async (e) => {
    if (e.submitter?.value !== "create") return;
    e.preventDefault();
    if (await createSession()) $("new-dialog").close();
  });
  $("edit-form").addEventListener("submit", (e) => {
    if (e.submitter?.value === "save") saveEdit();
  });
  $("purge-form").addEventListener("submit", (e) => {
    if (e.submitter?.value === "purge") purge(new FormData($("purge-form")).get("purge-mode"));
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      send();
    }
  });
  $("generate").addEventListener("click", generate);
  $("cancel").addEventListener("click", cancel);
  $("pin").addEventListener("click", togglePin);
  $("archive").addEventListener("click", () => setMeta({ archived: !state.inspection?.archived }));
  $("rename").addEventListener("click", () => {
    const title = prompt("Title", state.inspection?.title || "");
    if (title !== null) setMeta({ title });
  });
  $("purge").addEventListener("click", () => {
    $("purge-text").textContent =
      `This deletes session #${state.selected} from the log. It cannot be undone.`;
    $("purge-dialog").showModal();
  });
  $("back").addEventListener("click", deselect);
  $("show-archived").addEventListener("change", (e) => {
    state.showArchived = e.target.checked;
    renderTree();
  });
  // Arrow keys move along the tree; Enter (a button) opens a session.
  $("tree").addEventListener("keydown", (e) => {
    if (e.key !== "ArrowDown" && e.key !== "ArrowUp") return;
    const nodes = [...$("tree").querySelectorAll(".node")];
    const k = nodes.indexOf(document.activeElement);
    const next = nodes[k + (e.key === "ArrowDown" ? 1 : -1)];
    if (next) {
      e.preventDefault();
      next.focus();
    }
  });
  document.addEventListener("keydown", (e) => {
    const typing = /^(INPUT|TEXTAREA|SELECT)$/.test(document.activeElement?.tagName || "");
    if (e.key === "Escape" && document.body.classList.contains("has-session") && !typing) deselect();
    if (typing || e.ctrlKey || e.metaKey || e.altKey || document.querySelector("dialog[open]")) return;
    if (e.key === "n") {
      e.preventDefault();
      $("new-session").click();
    } else if (e.key === "/") {
      e.preventDefault();
      $("tree").querySelector(".node")?.focus();
    }
  });
  window.addEventListener("hashchange", () => {
    connectAttempt = 0;
    const old = state.conn;
    state.conn = null;
    state.connected = false;
    old?.close();
    connect();
  });
  setInterval(() => {
    refreshTree();
    refreshStatus();
  }, 2000);
}

wire();
connect();
