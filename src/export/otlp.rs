//! A session as OTLP traces in OTLP/JSON (the body of an OTLP/HTTP
//! `POST /v1/traces`, and one line of `--format otlp-jsonl`), following
//! OpenTelemetry's GenAI semantic conventions: one trace per session, a
//! root span for the session, and a `chat` span per generation with the
//! `gen_ai.*` attributes. docs/export.md has the mapping.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::redact::redact;
use super::{ExportOptions, SessionExport};
use crate::wire::{Channel, Event, Finish, Params, Record};

/// OTLP's `SPAN_KIND_INTERNAL`: the record of work this process did.
const SPAN_KIND_INTERNAL: u64 = 1;
/// OTLP's `STATUS_CODE_ERROR`.
const STATUS_CODE_ERROR: u64 = 2;

/// The `gen_ai.response.finish_reasons` value of a finish code.
pub fn finish_reason(finish: Finish, called_tools: bool) -> &'static str {
    match finish {
        Finish::EndOfTurn if called_tools => "tool_calls",
        Finish::EndOfTurn => "stop",
        Finish::MaxTokens => "length",
        Finish::Grammar => "grammar",
        Finish::Cancelled => "cancelled",
        Finish::Error => "error",
        Finish::Open => "open",
    }
}

fn id_hex(parts: &[&[u8]], bytes: usize) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(&h.finalize()[..bytes])
}

fn s(v: impl Into<String>) -> Value {
    json!({ "stringValue": v.into() })
}
fn i(v: u64) -> Value {
    // int64 is a string in OTLP/JSON (proto3's JSON mapping).
    json!({ "intValue": v.to_string() })
}
fn d(v: f64) -> Value {
    json!({ "doubleValue": v })
}
fn kv(key: &str, value: Value) -> Value {
    json!({ "key": key, "value": value })
}
fn nanos(ms: u64) -> String {
    (u128::from(ms) * 1_000_000).to_string()
}

/// One generation: a run of output events, with the `GenerationPrompt`
/// that opened it when there is one.
struct Generation {
    /// Index of its first event (the prompt, or the first output).
    first: usize,
    /// Index past its last event.
    end: usize,
    /// Index of its first output event: the input is everything before.
    first_output: usize,
}

fn is_output(r: &Record) -> bool {
    matches!(
        r,
        Record::Generated { .. } | Record::ToolUse { .. } | Record::ToolParseFailure { .. }
    )
}

/// The generations of a session's view: a run starts at a
/// `GenerationPrompt`, or at output with no generation open (a turn
/// continued), or at a `Generated` after the open one has ended; it ends at
/// the first event that is neither output nor its prompt.
fn generations(events: &[Event]) -> Vec<Generation> {
    let mut out: Vec<Generation> = Vec::new();
    let mut open: Option<(usize, Option<usize>, bool)> = None; // first, first output, ended
    let close =
        |open: &mut Option<(usize, Option<usize>, bool)>, end: usize, out: &mut Vec<Generation>| {
            if let Some((first, Some(fo), _)) = open.take() {
                out.push(Generation {
                    first,
                    end,
                    first_output: fo,
                });
            }
        };
    for (idx, e) in events.iter().enumerate() {
        match &e.body {
            Record::GenerationPrompt { .. } => {
                close(&mut open, idx, &mut out);
                open = Some((idx, None, false));
            }
            r if is_output(r) => {
                let restart =
                    matches!(open, Some((_, _, true))) && matches!(r, Record::Generated { .. });
                if restart {
                    close(&mut open, idx, &mut out);
                }
                let g = open.get_or_insert((idx, None, false));
                if g.1.is_none() {
                    g.1 = Some(idx);
                }
                if matches!(r, Record::Generated { finish, .. } if *finish != Finish::Open) {
                    g.2 = true;
                }
            }
            _ => close(&mut open, idx, &mut out),
        }
    }
    close(&mut open, events.len(), &mut out);
    out
}

/// The conventions' message list, built event by event.
#[derive(Default)]
struct Messages {
    list: Vec<(String, Vec<Value>)>,
    redactions: usize,
}

impl Messages {
    fn text(&mut self, t: &str) -> String {
        let (out, n) = redact(t);
        self.redactions += n;
        out.into_owned()
    }

    /// Appends a part to the last message when it has `role`; text (or
    /// reasoning) joins the last part of the same type.
    fn part(&mut self, role: &str, part: Value) {
        if self.list.last().is_none_or(|(r, _)| r != role) {
            self.list.push((role.to_string(), Vec::new()));
        }
        let Some((_, parts)) = self.list.last_mut() else {
            return;
        };
        let ty = part["type"].as_str().unwrap_or_default();
        if let Some(last) = parts.last_mut() {
            let joinable = (ty == "text" || ty == "reasoning") && last["type"] == ty;
            if let (true, Some(a), Some(b)) =
                (joinable, last["content"].as_str(), part["content"].as_str())
            {
                // Redacted again joined: a secret split across two events
                // (chunks of a reply, two appends) is whole only here.
                let joined = format!("{a}{b}");
                let (out, n) = redact(&joined);
                self.redactions += n;
                last["content"] = Value::String(out.into_owned());
                return;
            }
        }
        parts.push(part);
    }

    fn add(&mut self, e: &Event) {
        match &e.body {
            Record::Message { role, text, .. } => {
                let t = self.text(text);
                self.part(role.name(), json!({"type": "text", "content": t}));
            }
            Record::System {
                text: Some(text), ..
            } => {
                let t = self.text(text);
                self.part("system", json!({"type": "text", "content": t}));
            }
            Record::Appended { text, .. } => {
                let t = self.text(text);
                self.part("user", json!({"type": "text", "content": t}));
            }
            Record::Generated { text, channel, .. } => {
                let ty = match channel {
                    Channel::Text => "text",
                    Channel::Reasoning => "reasoning",
                    // The call's text; its parsed form is the ToolUse.
                    Channel::ToolCall => return,
                };
                let t = self.text(text);
                self.part("assistant", json!({"type": ty, "content": t}));
            }
            Record::ToolUse { name, arguments } => {
                let a = self.text(arguments);
                let args = serde_json::from_str::<Value>(&a).unwrap_or(Value::String(a));
                self.part(
                    "assistant",
                    json!({"type": "tool_call", "id": e.event_id.to_string(), "name": name, "arguments": args}),
                );
            }
            Record::ToolResult {
                call_id, content, ..
            } => {
                let c = self.text(content);
                self.part(
                    "tool",
                    json!({"type": "tool_call_response", "id": call_id.to_string(), "response": c}),
                );
            }
            Record::Image {
                role,
                blob,
                pre_text,
                post_text,
                ..
            } => {
                let (a, b) = (self.text(pre_text), self.text(post_text));
                if !a.is_empty() {
                    self.part(role.name(), json!({"type": "text", "content": a}));
                }
                self.part(
                    role.name(),
                    json!({"type": "uri", "modality": "image", "uri": format!("sha256:{blob}")}),
                );
                if !b.is_empty() {
                    self.part(role.name(), json!({"type": "text", "content": b}));
                }
            }
            Record::Block {
                role,
                kind,
                payload,
                ..
            } => {
                let p = self.text(payload);
                self.part(role.name(), json!({"type": kind, "content": p}));
            }
            _ => {}
        }
    }

    fn to_json(&self, finish_reason: Option<&str>) -> String {
        let list: Vec<Value> = self
            .list
            .iter()
            .map(|(role, parts)| {
                let mut m = json!({"role": role, "parts": parts});
                if let Some(f) = finish_reason {
                    m["finish_reason"] = json!(f);
                }
                m
            })
            .collect();
        Value::Array(list).to_string()
    }
}

/// The session's `ExportTraceServiceRequest` in OTLP/JSON, and how many
/// secrets its content had replaced.
pub fn request(export: &SessionExport, opts: &ExportOptions) -> (Value, usize) {
    let insp = &export.inspection;
    let session = insp.session;
    let sid = session.to_le_bytes();
    let created = insp.created_unix_ms.to_le_bytes();
    let trace_id = id_hex(&[b"superfluid trace", &sid, &created], 16);
    let root_id = id_hex(&[b"superfluid session span", &sid, &created], 8);
    let events = &export.events;
    let (start_ms, end_ms) = (
        events
            .first()
            .map_or(insp.created_unix_ms, |e| e.ts_unix_ms),
        events.last().map_or(insp.updated_unix_ms, |e| e.ts_unix_ms),
    );
    let conversation = kv("gen_ai.conversation.id", s(session.to_string()));
    let mut root_attrs = vec![
        conversation.clone(),
        kv("superfluid.session.id", i(session)),
        kv("superfluid.session.events", i(events.len() as u64)),
    ];
    if let Some(p) = insp.parent {
        root_attrs.push(kv("superfluid.session.parent", i(p)));
    }
    if let Some(at) = insp.fork_at {
        root_attrs.push(kv("superfluid.session.fork_at", i(at)));
    }
    let mut spans = vec![json!({
        "traceId": trace_id,
        "spanId": root_id,
        "name": format!("session {session}"),
        "kind": SPAN_KIND_INTERNAL,
        "startTimeUnixNano": nanos(start_ms),
        "endTimeUnixNano": nanos(end_ms),
        "attributes": root_attrs,
    })];

    let mut redactions = 0;
    let mut params: Option<Params> = None;
    let mut context_tokens = 0u64;
    let mut done = 0usize; // events folded into `context_tokens` / `input`
    let mut input = Messages::default();
    // Secrets replaced in the input as last written (the input after the
    // last generation is written nowhere).
    let mut input_written = 0;
    let advance = |to: usize,
                   params: &mut Option<Params>,
                   input: &mut Messages,
                   tokens: &mut u64,
                   done: &mut usize| {
        for e in &events[*done..to] {
            match &e.body {
                Record::Created { params: p, .. }
                | Record::Forked { params: p, .. }
                | Record::Rebased { params: p, .. } => *params = Some(*p),
                _ => {}
            }
            *tokens += e.body.span().len() as u64;
            if opts.include_content {
                input.add(e);
            }
        }
        *done = to.max(*done);
    };
    for g in generations(events) {
        advance(
            g.first_output,
            &mut params,
            &mut input,
            &mut context_tokens,
            &mut done,
        );
        let outputs = &events[g.first_output..g.end];
        let output_tokens: u64 = outputs
            .iter()
            .filter(|e| matches!(e.body, Record::Generated { .. }))
            .map(|e| e.body.span().len() as u64)
            .sum();
        let called_tools = outputs
            .iter()
            .any(|e| matches!(e.body, Record::ToolUse { .. }));
        let finish = outputs
            .iter()
            .filter_map(|e| match e.body {
                Record::Generated { finish, .. } if finish != Finish::Open => Some(finish),
                _ => None,
            })
            .next_back()
            .unwrap_or(Finish::Open);
        let reason = finish_reason(finish, called_tools);
        let first = &events[g.first];
        let last = &events[g.end - 1];
        let mut attrs = vec![
            kv("gen_ai.operation.name", s("chat")),
            kv("gen_ai.provider.name", s("superfluid")),
            conversation.clone(),
            kv("gen_ai.usage.input_tokens", i(context_tokens)),
            kv("gen_ai.usage.output_tokens", i(output_tokens)),
            kv(
                "gen_ai.response.finish_reasons",
                json!({"arrayValue": {"values": [s(reason)]}}),
            ),
            kv("superfluid.event.first", i(first.event_id)),
            kv("superfluid.event.last", i(last.event_id)),
            kv("superfluid.epoch", i(first.epoch)),
        ];
        if let Some(m) = &opts.model {
            attrs.push(kv("gen_ai.request.model", s(m.clone())));
            attrs.push(kv("gen_ai.response.model", s(m.clone())));
        }
        if let Some(p) = params {
            // As the f32 reads (0.7), not the f64 nearest it
            // (0.699999988079071): through its shortest text.
            let shortest = |x: f32| x.to_string().parse::<f64>().unwrap_or(f64::from(x));
            attrs.push(kv("gen_ai.request.temperature", d(shortest(p.temperature))));
            attrs.push(kv("gen_ai.request.top_p", d(shortest(p.top_p))));
            attrs.push(kv("gen_ai.request.top_k", d(f64::from(p.top_k))));
            attrs.push(kv("gen_ai.request.seed", i(p.seed)));
        }
        if let Some(p) = export.inherited_from[g.first_output] {
            attrs.push(kv("superfluid.inherited_from", i(p)));
        }
        if opts.include_content {
            attrs.push(kv("gen_ai.input.messages", s(input.to_json(None))));
            input_written = input.redactions;
            let mut output = Messages::default();
            for e in outputs {
                output.add(e);
            }
            attrs.push(kv(
                "gen_ai.output.messages",
                s(output.to_json(Some(reason))),
            ));
            redactions += output.redactions;
        }
        let mut span = json!({
            "traceId": trace_id,
            "spanId": id_hex(&[b"superfluid generation span", &sid, &created, &first.event_id.to_le_bytes()], 8),
            "parentSpanId": root_id,
            "name": match &opts.model { Some(m) => format!("chat {m}"), None => "chat".into() },
            "kind": SPAN_KIND_INTERNAL,
            "startTimeUnixNano": nanos(first.ts_unix_ms),
            "endTimeUnixNano": nanos(last.ts_unix_ms),
            "attributes": attrs,
        });
        if finish == Finish::Error {
            span["status"] =
                json!({"code": STATUS_CODE_ERROR, "message": "the generation ended with an error"});
        }
        spans.push(span);
    }
    redactions += input_written;
    let body = json!({
        "resourceSpans": [{
            "resource": {"attributes": [
                kv("service.name", s("superfluid")),
                kv("service.version", s(env!("CARGO_PKG_VERSION"))),
            ]},
            "scopeSpans": [{
                "scope": {"name": "superfluid.export", "version": env!("CARGO_PKG_VERSION")},
                "spans": spans,
            }],
        }],
    });
    (body, redactions)
}

/// The most bytes one OTLP/HTTP request body takes by default: well under
/// the OpenTelemetry Collector's default limit (20 MiB) and gRPC's 4 MiB.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// `body` (one `ExportTraceServiceRequest`, as [`request`] builds it) as one
/// or more request bodies of at most `cap` bytes each, the spans in order,
/// each body with the same resource and scope. A span that alone would
/// make a body over `cap` is an error, found before any body is returned.
pub fn split(body: &Value, cap: usize) -> Result<Vec<String>, super::ExportError> {
    let whole = body.to_string();
    if whole.len() <= cap {
        return Ok(vec![whole]);
    }
    let spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let with = |spans: &[Value]| {
        let mut b = body.clone();
        b["resourceSpans"][0]["scopeSpans"][0]["spans"] = Value::Array(spans.to_vec());
        b.to_string()
    };
    // The bytes of a body holding no span, and each span's own.
    let empty = with(&[]).len();
    let mut out = Vec::new();
    let mut batch: Vec<Value> = Vec::new();
    let mut size = empty;
    for span in spans {
        let bytes = span.to_string().len() + 1; // and its comma
        if empty + bytes > cap {
            return Err(super::ExportError::SpanTooLarge {
                bytes: empty + bytes,
                cap,
            });
        }
        if size + bytes > cap && !batch.is_empty() {
            out.push(with(&batch));
            batch.clear();
            size = empty;
        }
        size += bytes;
        batch.push(span);
    }
    if !batch.is_empty() {
        out.push(with(&batch));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Inspection, Role};

    fn ev(id: u64, body: Record) -> Event {
        Event {
            event_id: id,
            epoch: 1,
            ts_unix_ms: 100 + id,
            body,
        }
    }

    fn gen_(text: &str, finish: Finish, n: usize) -> Record {
        Record::Generated {
            span: vec![7; n],
            text: text.into(),
            channel: Channel::Text,
            finish,
        }
    }

    fn session() -> SessionExport {
        let events = vec![
            ev(
                0,
                Record::Created {
                    parent: None,
                    params: Params {
                        temperature: 0.7,
                        ..Params::greedy(5)
                    },
                },
            ),
            ev(
                1,
                Record::Message {
                    role: Role::User,
                    text: "key AKIAIOSFODNN7EXAMPLE".into(),
                    span: vec![1; 10],
                },
            ),
            ev(2, Record::GenerationPrompt { span: vec![2; 3] }),
            ev(3, gen_("Hel", Finish::Open, 4)),
            ev(4, gen_("lo", Finish::EndOfTurn, 2)),
            ev(
                5,
                Record::Message {
                    role: Role::User,
                    text: "more".into(),
                    span: vec![1; 5],
                },
            ),
            ev(6, Record::GenerationPrompt { span: vec![2; 3] }),
            ev(7, gen_("x", Finish::MaxTokens, 8)),
        ];
        SessionExport {
            inspection: Inspection {
                session: 4,
                parent: None,
                fork_at: None,
                params: Params::greedy(5),
                events: 8,
                tokens: 0,
                generation: 0,
                version: 0,
                title: None,
                archived: false,
                purged: false,
                children: vec![],
                created_unix_ms: 100,
                updated_unix_ms: 107,
                open_turn: false,
                generating: false,
            },
            inherited_from: vec![None; events.len()],
            events,
        }
    }

    fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
        span["attributes"]
            .as_array()?
            .iter()
            .find(|a| a["key"] == key)
            .map(|a| &a["value"])
    }

    #[test]
    fn a_span_per_generation_with_usage_and_finish() {
        let opts = ExportOptions {
            include_content: false,
            model: Some("m".into()),
        };
        let (body, n) = request(&session(), &opts);
        assert_eq!(n, 0);
        let spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();
        assert_eq!(spans.len(), 3, "the session's root and two generations");
        let (a, b) = (&spans[1], &spans[2]);
        assert_eq!(a["name"], "chat m");
        assert_eq!(a["parentSpanId"], spans[0]["spanId"]);
        assert_eq!(a["traceId"].as_str().unwrap().len(), 32);
        assert_eq!(a["spanId"].as_str().unwrap().len(), 16);
        assert_eq!(
            attr(a, "gen_ai.usage.input_tokens").unwrap(),
            &json!({"intValue": "13"})
        );
        assert_eq!(
            attr(a, "gen_ai.usage.output_tokens").unwrap(),
            &json!({"intValue": "6"})
        );
        assert_eq!(
            attr(a, "gen_ai.response.finish_reasons").unwrap(),
            &json!({"arrayValue": {"values": [{"stringValue": "stop"}]}})
        );
        assert_eq!(
            attr(a, "gen_ai.conversation.id").unwrap(),
            &json!({"stringValue": "4"})
        );
        assert_eq!(
            attr(a, "gen_ai.request.model").unwrap(),
            &json!({"stringValue": "m"})
        );
        // As the f32 reads, not the f64 nearest it (0.699999988079071).
        assert_eq!(
            attr(a, "gen_ai.request.temperature").unwrap(),
            &json!({"doubleValue": 0.7})
        );
        assert_eq!(
            attr(b, "gen_ai.usage.input_tokens").unwrap(),
            &json!({"intValue": "27"})
        );
        assert_eq!(
            attr(b, "gen_ai.response.finish_reasons").unwrap()["arrayValue"]["values"][0],
            json!({"stringValue": "length"})
        );
        assert_eq!(a["startTimeUnixNano"], "102000000");
        assert_eq!(a["endTimeUnixNano"], "104000000");
        assert!(
            attr(a, "gen_ai.input.messages").is_none(),
            "no content without the flag"
        );
    }

    /// A secret split across two events (two appends, two chunks of a
    /// reply) is whole only once they are joined: it is redacted there.
    /// Content after the last generation is written nowhere, and its
    /// secrets are not counted.
    #[test]
    fn a_secret_split_across_events_is_redacted_and_only_what_is_written_counted() {
        let opts = ExportOptions {
            include_content: true,
            model: None,
        };
        let mut x = session();
        let appended = |id, text: &str| {
            ev(
                id,
                Record::Appended {
                    span: vec![1; 3],
                    text: text.into(),
                },
            )
        };
        x.events = vec![
            x.events[0].clone(),
            appended(1, "use ghp_abcdefghijklmnopqr"),
            appended(2, "stuvwxyz0123456789 please"),
            ev(3, Record::GenerationPrompt { span: vec![2; 3] }),
            ev(4, gen_("AKIAIOSFOD", Finish::Open, 4)),
            ev(5, gen_("NN7EXAMPLE ok", Finish::EndOfTurn, 2)),
            appended(6, "never exported AKIAIOSFODNN7EXAMPLE"),
        ];
        x.inherited_from = vec![None; x.events.len()];
        let (body, n) = request(&x, &opts);
        let text = body.to_string();
        assert!(!text.contains("stuvwxyz0123456789"), "{text}");
        assert!(!text.contains("NN7EXAMPLE"), "{text}");
        assert_eq!(n, 2, "{text}");
    }

    #[test]
    fn content_is_the_conventions_messages_redacted() {
        let opts = ExportOptions {
            include_content: true,
            model: None,
        };
        let (body, n) = request(&session(), &opts);
        let spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();
        let input: Value = serde_json::from_str(
            attr(&spans[1], "gen_ai.input.messages").unwrap()["stringValue"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            input,
            json!([{"role": "user", "parts": [{"type": "text", "content": "key [REDACTED:aws_access_key_id]"}]}])
        );
        let output: Value = serde_json::from_str(
            attr(&spans[1], "gen_ai.output.messages").unwrap()["stringValue"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            output,
            json!([{"role": "assistant", "parts": [{"type": "text", "content": "Hello"}], "finish_reason": "stop"}])
        );
        let input2: Value = serde_json::from_str(
            attr(&spans[2], "gen_ai.input.messages").unwrap()["stringValue"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(input2.as_array().unwrap().len(), 3, "user, assistant, user");
        // One secret, in one event: counted once, however many spans
        // carry it.
        assert_eq!(n, 1);
    }

    #[test]
    fn a_body_over_the_cap_is_split_by_spans_in_order() {
        let opts = ExportOptions {
            include_content: true,
            model: None,
        };
        let (body, _) = request(&session(), &opts);
        let whole = body.to_string();
        assert_eq!(split(&body, whole.len()).unwrap(), vec![whole.clone()]);
        let spans = |b: &Value| -> Vec<Value> {
            b["resourceSpans"][0]["scopeSpans"][0]["spans"]
                .as_array()
                .unwrap()
                .clone()
        };
        let all = spans(&body);
        let biggest = all.iter().map(|s| s.to_string().len()).max().unwrap();
        // Room for the header and the biggest span, not for all three.
        let cap =
            whole.len() - all.iter().map(|s| s.to_string().len()).sum::<usize>() + biggest + 1;
        let parts = split(&body, cap).unwrap();
        assert!(parts.len() >= 2, "{} parts", parts.len());
        let mut again = Vec::new();
        for p in &parts {
            assert!(p.len() <= cap, "{} > {cap}", p.len());
            let v: Value = serde_json::from_str(p).unwrap();
            assert_eq!(
                v["resourceSpans"][0]["resource"],
                body["resourceSpans"][0]["resource"]
            );
            again.extend(spans(&v));
        }
        assert_eq!(again, all, "every span once, in order");
        // A cap under the header and the biggest span: refused.
        let header =
            whole.len() - all.iter().map(|s| s.to_string().len()).sum::<usize>() + 1 - all.len();
        assert!(matches!(
            split(&body, header + biggest - 1),
            Err(crate::export::ExportError::SpanTooLarge { .. })
        ));
    }
}
