//! The jsonl export: one JSON object a line, one line per event of the
//! session's view (a fork's inherited events included, and marked). The
//! fields are docs/export.md's table; a field is only ever added, never
//! renamed or removed (`v` counts such additions).

use serde_json::{json, Map, Value};

use super::redact::redact;
use super::{ExportOptions, SessionExport};

/// The format's version, the `v` of every line.
pub const VERSION: u64 = 1;

/// The record fields that hold content: left out without
/// `--include-content`, redacted with it. Searched at any depth, so a
/// `Rebased` edit's replacement `text` is content too.
pub const CONTENT_FIELDS: &[&str] = &[
    "text",
    "arguments",
    "content",
    "note",
    "tools",
    "pre_text",
    "post_text",
    "payload",
    "error",
];

/// Drops (or redacts, with `include`) the content fields of a record's
/// JSON fields; returns how many secrets were replaced.
pub(super) fn scrub(value: &mut Value, include: bool) -> usize {
    let mut n = 0;
    match value {
        Value::Object(map) => {
            if !include {
                map.retain(|k, _| !CONTENT_FIELDS.contains(&k.as_str()));
            }
            for (k, v) in map.iter_mut() {
                if include && CONTENT_FIELDS.contains(&k.as_str()) {
                    n += redact_strings(v);
                } else {
                    n += scrub(v, include);
                }
            }
        }
        Value::Array(items) => {
            for v in items {
                n += scrub(v, include);
            }
        }
        _ => {}
    }
    n
}

/// Redacts every string in `value`.
fn redact_strings(value: &mut Value) -> usize {
    match value {
        Value::String(s) => {
            let (out, n) = redact(s);
            if n > 0 {
                *s = out.into_owned();
            }
            n
        }
        Value::Array(items) => items.iter_mut().map(redact_strings).sum(),
        Value::Object(map) => map.values_mut().map(redact_strings).sum(),
        _ => 0,
    }
}

/// The lines of one session, each without its newline, and how many
/// secrets their content had replaced.
pub fn lines(export: &SessionExport, opts: &ExportOptions) -> (Vec<String>, usize) {
    let session = export.inspection.session;
    let mut total = 0;
    let lines = export
        .events
        .iter()
        .zip(&export.inherited_from)
        .map(|(e, inherited_from)| {
            // The record's JSON form: {"Name": {fields}} or "Name", as `Read`
            // writes it. Through the text, not `to_value`: that widens an
            // f32 to the f64 nearest it (temperature 0.7 became
            // 0.699999988079071), where the text keeps its shortest form.
            let text = serde_json::to_string(&e.body).unwrap_or_default();
            let mut fields = match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(mut outer)) => outer
                    .values_mut()
                    .next()
                    .map(Value::take)
                    .unwrap_or(Value::Object(Map::new())),
                _ => Value::Object(Map::new()),
            };
            if let Value::Object(map) = &mut fields {
                map.remove("span");
            }
            let redactions = scrub(&mut fields, opts.include_content);
            total += redactions;
            json!({
                "v": VERSION,
                "session": session,
                "event_id": e.event_id,
                "epoch": e.epoch,
                "ts_unix_ms": e.ts_unix_ms,
                "record": e.body.name(),
                "inherited": inherited_from.is_some(),
                "inherited_from": inherited_from,
                "tokens": e.body.span().len(),
                "content": opts.include_content,
                "redactions": redactions,
                "fields": fields,
            })
            .to_string()
        })
        .collect();
    (lines, total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Channel, Edit, Event, Finish, Inspection, Params, Record, Role};

    fn export(events: Vec<Record>) -> SessionExport {
        let n = events.len();
        SessionExport {
            inspection: Inspection {
                session: 3,
                parent: Some(1),
                fork_at: Some(1),
                params: Params::greedy(0),
                events: n as u64,
                tokens: 0,
                generation: 0,
                version: 0,
                title: None,
                archived: false,
                purged: false,
                children: vec![],
                created_unix_ms: 0,
                updated_unix_ms: 0,
                open_turn: false,
                generating: false,
            },
            events: events
                .into_iter()
                .enumerate()
                .map(|(i, body)| Event {
                    event_id: i as u64,
                    epoch: 2,
                    ts_unix_ms: 1000 + i as u64,
                    body,
                })
                .collect(),
            inherited_from: (0..n).map(|i| (i == 0).then_some(1)).collect(),
        }
    }

    fn parse(lines: &[String]) -> Vec<Value> {
        lines
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn a_line_per_event_with_the_documented_fields() {
        let e = export(vec![
            Record::Message {
                role: Role::User,
                text: "hi PASSWORD=hunter2".into(),
                span: vec![1, 2, 3],
            },
            Record::Generated {
                span: vec![4],
                text: "ok".into(),
                channel: Channel::Text,
                finish: Finish::EndOfTurn,
            },
            Record::EpochBump,
        ]);
        let without = parse(&lines(&e, &ExportOptions::default()).0);
        assert_eq!(without.len(), 3);
        assert_eq!(
            without[0],
            json!({"v": 1, "session": 3, "event_id": 0, "epoch": 2, "ts_unix_ms": 1000,
                   "record": "Message", "inherited": true, "inherited_from": 1, "tokens": 3,
                   "content": false, "redactions": 0, "fields": {"role": 1}})
        );
        assert_eq!(without[1]["fields"], json!({"channel": 0, "finish": 1}));
        assert_eq!(without[1]["inherited"], json!(false));
        assert_eq!(without[1]["inherited_from"], Value::Null);
        assert_eq!(without[2]["fields"], json!({}));
        let (with, n) = lines(
            &e,
            &ExportOptions {
                include_content: true,
                model: None,
            },
        );
        assert_eq!(n, 1);
        let with = parse(&with);
        assert_eq!(
            with[0]["fields"],
            json!({"role": 1, "text": "hi PASSWORD=[REDACTED:secret_assignment]"})
        );
        assert_eq!(with[0]["redactions"], json!(1));
        assert_eq!(with[1]["fields"]["text"], json!("ok"));
    }

    /// Floats read as `Read` writes them: temperature 0.7, not the f64
    /// nearest the f32 (0.699999988079071).
    #[test]
    fn floats_keep_their_shortest_form() {
        let params = crate::wire::Params {
            temperature: 0.7,
            top_p: 0.95,
            ..crate::wire::Params::greedy(1)
        };
        let e = export(vec![Record::Created {
            parent: None,
            params,
        }]);
        let line = &lines(&e, &ExportOptions::default()).0[0];
        assert!(
            line.contains(r#""temperature":0.7,"#) && line.contains(r#""top_p":0.95,"#),
            "{line}"
        );
    }

    #[test]
    fn nested_content_is_content_too() {
        let e = export(vec![
            Record::Rebased {
                parent: 1,
                fork_at: 1,
                params: Params::greedy(0),
                edits: vec![Edit::Replace {
                    from: 1,
                    to: 2,
                    role: 1,
                    text: "secret".into(),
                }],
            },
            Record::ToolUse {
                name: "shell".into(),
                arguments: "{\"cmd\":\"ls\"}".into(),
            },
        ]);
        let without = parse(&lines(&e, &ExportOptions::default()).0);
        assert_eq!(
            without[0]["fields"]["edits"],
            json!([{"Replace": {"from": 1, "to": 2, "role": 1}}])
        );
        assert_eq!(without[1]["fields"], json!({"name": "shell"}));
    }
}
