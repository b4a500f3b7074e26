//! The wire types against ../shared/spec/session-api.md: every JSON example
//! of the spec parses into the typed value and serializes back byte for byte;
//! every variant of `Request`, `Response`, `Record` and `LogRecord`
//! round-trips through JSON and postcard; and the postcard bytes of a fixed
//! list of requests are pinned, so a reordered variant fails here.
//!
//! Adding a variant without a sample fails to compile (the exhaustive
//! `match`es in `*_index`) or, if the match is extended but no sample added,
//! fails `every_*_variant_round_trips`.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::fmt::Debug;
use superfluid::wire::{
    from_postcard, to_postcard, Channel, Edit, Event, Finish, Inspection, LedgerEntry,
    LedgerStatus, LogRecord, Params, PurgeMode, QosClass, Record, Request, Response, Role,
    SessionSummary,
};

// ---------------------------------------------------------------------------
// Helpers

/// Parses `json` as `T`, checks it equals `expected`, and checks that it
/// serializes back to the same JSON: the same `Value` and the same compact
/// string.
fn snapshot<T>(json: &str, expected: &T)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let parsed: T =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("cannot parse {json}: {e}"));
    assert_eq!(&parsed, expected, "parsed value of {json}");
    let back = serde_json::to_string(&parsed).unwrap();
    let want: Value = serde_json::from_str(json).unwrap();
    let got: Value = serde_json::from_str(&back).unwrap();
    assert_eq!(got, want, "JSON value of {json}");
    assert_eq!(back, want.to_string(), "compact JSON of {json}");
    assert_eq!(back, json, "bytes of {json}");
    // And through postcard, for good measure.
    let bytes = to_postcard(&parsed).unwrap();
    assert_eq!(&from_postcard::<T>(&bytes).unwrap(), expected);
}

/// Round-trips `value` through JSON and through postcard.
fn round_trip<T>(value: &T) -> Vec<u8>
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let json = serde_json::to_string(value).unwrap();
    let from_json: T =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("cannot parse {json}: {e}"));
    assert_eq!(&from_json, value, "JSON round trip of {json}");
    assert_eq!(serde_json::to_string(&from_json).unwrap(), json);
    let bytes = to_postcard(value).unwrap();
    let from_bytes: T = from_postcard(&bytes)
        .unwrap_or_else(|e| panic!("cannot decode postcard of {value:?}: {e}"));
    assert_eq!(&from_bytes, value, "postcard round trip");
    bytes
}

/// Checks that `samples` hold every variant once, in declaration order, that
/// postcard writes each variant's index as the first byte, and that there is
/// no variant past the last sample.
fn check_variants<T>(samples: &[T], index: fn(&T) -> u8)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    for (i, sample) in samples.iter().enumerate() {
        assert_eq!(index(sample) as usize, i, "sample {i} is {sample:?}");
        let bytes = round_trip(sample);
        assert_eq!(bytes[0] as usize, i, "postcard index of {sample:?}");
    }
    // Zero bytes decode as a valid value of any field (0, "", [], None,
    // false, variant 0), so this succeeds exactly when the index exists.
    let n = samples.len() as u8;
    let mut probe = vec![n];
    probe.extend([0u8; 64]);
    assert!(
        postcard::take_from_bytes::<T>(&probe).is_err(),
        "there is a variant {n} without a sample"
    );
    let mut probe = vec![n - 1];
    probe.extend([0u8; 64]);
    assert!(postcard::take_from_bytes::<T>(&probe).is_ok());
}

fn params() -> Params {
    Params {
        temperature: 0.7,
        top_p: 0.95,
        min_p: 0.0,
        top_k: 0,
        seed: 1,
    }
}

fn event(event_id: u64, body: Record) -> Event {
    Event {
        event_id,
        epoch: 1,
        ts_unix_ms: 1_700_000_000_000,
        body,
    }
}

// ---------------------------------------------------------------------------
// The spec's examples

#[test]
fn curl_walkthrough() {
    snapshot(
        r#"{"Create":{"parent":null,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0,"seed":1}}}"#,
        &Request::Create {
            parent: None,
            params: params(),
        },
    );
    snapshot(
        r#"{"Created":{"session":1}}"#,
        &Response::Created { session: 1 },
    );
    snapshot(
        r#"{"AppendMessage":{"session":1,"role":1,"text":"Name three rivers."}}"#,
        &Request::AppendMessage {
            session: 1,
            role: 1,
            text: "Name three rivers.".into(),
        },
    );
}

#[test]
fn browser_snippet() {
    // JSON.stringify writes `min_p: 0` as `0`; it parses to the same value,
    // and serializes back as `0.0` (an f32 always does).
    let from_js = r#"{"Create":{"parent":null,"params":{"temperature":0.7,"top_p":0.95,"min_p":0,"top_k":0,"seed":1}}}"#;
    let create = Request::Create {
        parent: None,
        params: params(),
    };
    assert_eq!(serde_json::from_str::<Request>(from_js).unwrap(), create);
    snapshot(
        r#"{"Create":{"parent":null,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0,"seed":1}}}"#,
        &create,
    );
    snapshot(
        r#"{"AppendMessage":{"session":1,"role":1,"text":"Name three rivers."}}"#,
        &Request::AppendMessage {
            session: 1,
            role: 1,
            text: "Name three rivers.".into(),
        },
    );
    snapshot(
        r#"{"Generate":{"session":1,"max_tokens":256}}"#,
        &Request::Generate {
            session: 1,
            max_tokens: 256,
        },
    );
    // reply.Delta.event.body.Generated.text
    let delta = r#"{"Delta":{"event":{"event_id":3,"epoch":1,"ts_unix_ms":1700000000000,"body":{"Generated":{"span":[45,7598,11],"text":"The Nile,","channel":0,"finish":0}}}}}"#;
    snapshot(
        delta,
        &Response::Delta {
            event: event(
                3,
                Record::Generated {
                    span: vec![45, 7598, 11],
                    text: "The Nile,".into(),
                    channel: Channel::Text,
                    finish: Finish::Open,
                },
            ),
        },
    );
    let v: Value = serde_json::from_str(delta).unwrap();
    assert_eq!(
        v["Delta"]["event"]["body"]["Generated"]["text"],
        "The Nile,"
    );
    // reply.Generated.finish
    snapshot(
        r#"{"Generated":{"events":4,"tokens_generated":42,"finish":1,"warm_prefix":17}}"#,
        &Response::Generated {
            events: 4,
            tokens_generated: 42,
            finish: Finish::EndOfTurn,
            warm_prefix: 17,
        },
    );
    // reply.Err.message
    snapshot(
        r#"{"Err":{"message":"no session 9"}}"#,
        &Response::err("no session 9"),
    );
}

#[test]
fn event_envelope() {
    snapshot(
        r#"{"event_id":3,"epoch":1,"ts_unix_ms":1700000000000,"body":{"Generated":{"span":[45,7598],"text":"The Nile","channel":0,"finish":0}}}"#,
        &event(
            3,
            Record::Generated {
                span: vec![45, 7598],
                text: "The Nile".into(),
                channel: Channel::Text,
                finish: Finish::Open,
            },
        ),
    );
    snapshot(
        r#"{"event_id":5,"epoch":1,"ts_unix_ms":1700000000000,"body":"EpochBump"}"#,
        &event(5, Record::EpochBump),
    );
    snapshot(r#""EpochBump""#, &Record::EpochBump);
}

#[test]
fn record_table() {
    snapshot(
        r#"{"Created":{"parent":null,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0,"seed":1}}}"#,
        &Record::Created {
            parent: None,
            params: params(),
        },
    );
    snapshot(
        r#"{"Forked":{"parent":1,"fork_at":4,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0,"seed":1}}}"#,
        &Record::Forked {
            parent: 1,
            fork_at: 4,
            params: params(),
        },
    );
    snapshot(
        r#"{"Rebased":{"parent":1,"fork_at":2,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0,"seed":1},"edits":[{"Drop":{"from":2,"to":3}}]}}"#,
        &Record::Rebased {
            parent: 1,
            fork_at: 2,
            params: params(),
            edits: vec![Edit::Drop { from: 2, to: 3 }],
        },
    );
    snapshot(
        r#"{"Message":{"role":1,"text":"Hi","span":[1,2,3]}}"#,
        &Record::Message {
            role: Role::User,
            text: "Hi".into(),
            span: vec![1, 2, 3],
        },
    );
    snapshot(
        r#"{"GenerationPrompt":{"span":[151644,77091,198]}}"#,
        &Record::GenerationPrompt {
            span: vec![151644, 77091, 198],
        },
    );
    snapshot(
        r#"{"ToolUse":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}"#,
        &Record::ToolUse {
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        },
    );
    snapshot(
        r#"{"ToolResult":{"call_id":6,"content":"rain","span":[9]}}"#,
        &Record::ToolResult {
            call_id: 6,
            content: "rain".into(),
            span: vec![9],
        },
    );
    snapshot(
        r#"{"Appended":{"text":"\n","span":[198]}}"#,
        &Record::Appended {
            text: "\n".into(),
            span: vec![198],
        },
    );
}

#[test]
fn bare_string_requests_and_replies() {
    snapshot(r#""Tree""#, &Request::Tree);
    snapshot(r#""List""#, &Request::List);
    snapshot(r#""GcMedia""#, &Request::GcMedia);
    snapshot(r#""Metrics""#, &Request::Metrics);
    snapshot(r#""Cancelling""#, &Response::Cancelling);
    snapshot(r#""Unsubscribed""#, &Response::Unsubscribed);
    snapshot(r#""Ack""#, &Response::Ack);
}

#[test]
fn replies_with_tuples() {
    snapshot(
        r#"{"Tree":{"nodes":[[1,null,null],[2,1,4]]}}"#,
        &Response::Tree {
            nodes: vec![(1, None, None), (2, Some(1), Some(4))],
        },
    );
    snapshot(
        r#"{"ToolCalls":{"calls":[[6,"get_weather","{\"city\":\"Paris\"}"]]}}"#,
        &Response::ToolCalls {
            calls: vec![(6, "get_weather".into(), r#"{"city":"Paris"}"#.into())],
        },
    );
}

#[test]
fn rebase_edits() {
    snapshot(
        r#"{"Drop":{"from":2,"to":4}}"#,
        &Edit::Drop { from: 2, to: 4 },
    );
    snapshot(
        r#"{"Replace":{"from":3,"to":9,"role":1,"text":"Name four rivers."}}"#,
        &Edit::Replace {
            from: 3,
            to: 9,
            role: 1,
            text: "Name four rivers.".into(),
        },
    );
    snapshot(
        r#"{"Rebase":{"session":1,"edits":[{"Drop":{"from":2,"to":3}},{"Replace":{"from":3,"to":9,"role":1,"text":"Name four rivers."}}],"params":null}}"#,
        &Request::Rebase {
            session: 1,
            edits: vec![
                Edit::Drop { from: 2, to: 3 },
                Edit::Replace {
                    from: 3,
                    to: 9,
                    role: 1,
                    text: "Name four rivers.".into(),
                },
            ],
            params: None,
        },
    );
    snapshot(
        r#"{"Fork":{"session":1,"at_event":4,"params":null}}"#,
        &Request::Fork {
            session: 1,
            at_event: 4,
            params: None,
        },
    );
}

#[test]
fn put_media_bytes_are_numbers() {
    snapshot(
        r#"{"PutMedia":{"bytes":[137,80,78,71,13,10,26,10],"mime":"image/png"}}"#,
        &Request::PutMedia {
            bytes: vec![137, 80, 78, 71, 13, 10, 26, 10],
            mime: "image/png".into(),
        },
    );
    snapshot(
        r#"{"Media":{"hash":"9f86d081884c7d65"}}"#,
        &Response::Media {
            hash: "9f86d081884c7d65".into(),
        },
    );
}

#[test]
fn purge_modes_are_strings() {
    snapshot(
        r#"{"Purge":{"session":2,"expected_generation":7,"mode":"Cascade"}}"#,
        &Request::Purge {
            session: 2,
            expected_generation: 7,
            mode: PurgeMode::Cascade,
        },
    );
    snapshot(
        r#"{"Purge":{"session":2,"expected_generation":7,"mode":"Reroot"}}"#,
        &Request::Purge {
            session: 2,
            expected_generation: 7,
            mode: PurgeMode::Reroot,
        },
    );
    snapshot(
        r#"{"Purged":{"sessions":[2,3]}}"#,
        &Response::Purged {
            sessions: vec![2, 3],
        },
    );
}

#[test]
fn integers_stay_integers() {
    let cases: Vec<(Request, &str, u64)> = vec![
        (
            Request::AppendMessage {
                session: 1,
                role: 3,
                text: String::new(),
            },
            "role",
            3,
        ),
        (
            Request::SetQos {
                session: 1,
                class: 2,
                batch_invariant: true,
            },
            "class",
            2,
        ),
        (
            Request::Complete {
                prefix: "a".into(),
                suffix: "b".into(),
                mode: 1,
                max_tokens: 8,
            },
            "mode",
            1,
        ),
        (
            Request::AppendToolOutcome {
                session: 1,
                call_id: 4,
                outcome: 2,
                note: String::new(),
            },
            "outcome",
            2,
        ),
    ];
    for (request, field, n) in cases {
        let v = serde_json::to_value(&request).unwrap();
        let body = v.as_object().unwrap().values().next().unwrap();
        assert_eq!(body[field], Value::from(n), "{field} of {v}");
        assert!(body[field].is_u64());
    }
    let generated = serde_json::to_value(Record::Generated {
        span: vec![],
        text: String::new(),
        channel: Channel::ToolCall,
        finish: Finish::Error,
    })
    .unwrap();
    assert!(generated["Generated"]["channel"].is_u64());
    assert_eq!(generated["Generated"]["channel"], 2);
    assert_eq!(generated["Generated"]["finish"], 5);
    let provisional = serde_json::to_value(Response::SubProvisional {
        sub: 1,
        channel: Channel::Reasoning,
        text: "hm".into(),
    })
    .unwrap();
    assert_eq!(provisional["SubProvisional"]["channel"], 1);
    let done = serde_json::to_value(Response::Generated {
        events: 1,
        tokens_generated: 2,
        finish: Finish::Cancelled,
        warm_prefix: 0,
    })
    .unwrap();
    assert_eq!(done["Generated"]["finish"], 4);
}

#[test]
fn missing_field_is_named() {
    let cases = [
        (r#"{"Create":{"parent":null}}"#, "params"),
        (r#"{"AppendMessage":{"session":1,"role":1}}"#, "text"),
        (r#"{"Generate":{"session":1}}"#, "max_tokens"),
        (
            r#"{"Create":{"parent":null,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0}}}"#,
            "seed",
        ),
    ];
    for (json, field) in cases {
        let err = serde_json::from_str::<Request>(json)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("missing field `{field}`")),
            "{json}: {err}"
        );
    }
    let err = serde_json::from_str::<Request>(r#"{"Frobnicate":{}}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown variant `Frobnicate`"), "{err}");
}

// ---------------------------------------------------------------------------
// Every variant

fn request_index(r: &Request) -> u8 {
    use Request::*;
    match r {
        Create { .. } => 0,
        Append { .. } => 1,
        AppendMessage { .. } => 2,
        AppendSystem { .. } => 3,
        AppendBlock { .. } => 4,
        AppendImage { .. } => 5,
        Read { .. } => 6,
        List => 7,
        Sessions { .. } => 8,
        Tree => 9,
        Inspect { .. } => 10,
        SetMeta { .. } => 11,
        Purge { .. } => 12,
        Generate { .. } => 13,
        Cancel { .. } => 14,
        Subscribe { .. } => 15,
        Unsubscribe { .. } => 16,
        Complete { .. } => 17,
        Fork { .. } => 18,
        Rebase { .. } => 19,
        Trim { .. } => 20,
        AppendToolResult { .. } => 21,
        AppendToolOutcome { .. } => 22,
        RequestToolCancel { .. } => 23,
        OpenToolCalls { .. } => 24,
        Ledger { .. } => 25,
        RequestPermission { .. } => 26,
        RespondPermission { .. } => 27,
        SetQos { .. } => 28,
        SetBackgroundRate { .. } => 29,
        Pin { .. } => 30,
        PutMedia { .. } => 31,
        GcMedia => 32,
        SetLogLevel { .. } => 33,
        Metrics => 34,
        SetToolChoice { .. } => 35,
        SetOutputFormat { .. } => 36,
        UseModel { .. } => 37,
        Models => 38,
    }
}

fn all_requests() -> Vec<Request> {
    use Request::*;
    vec![
        Create {
            parent: Some(3),
            params: params(),
        },
        Append {
            session: 1,
            text: Some("<|im_start|>".into()),
            span: vec![151644, 0, u32::MAX],
        },
        AppendMessage {
            session: 1,
            role: 1,
            text: "Name three rivers.".into(),
        },
        AppendSystem {
            session: 1,
            text: None,
            tools: vec![r#"{"type":"function","function":{"name":"f"}}"#.into()],
        },
        AppendBlock {
            session: 1,
            role: 2,
            kind: "thinking".into(),
            payload: "hmm".into(),
        },
        AppendImage {
            session: 1,
            role: 1,
            blob: "ab12".into(),
            pre_text: "Look:".into(),
            post_text: "What is it?".into(),
        },
        Read {
            session: 1,
            cursor: 5,
        },
        List,
        Sessions {
            include_archived: true,
        },
        Tree,
        Inspect { session: 2 },
        SetMeta {
            session: 1,
            expected_version: 3,
            title: Some("rivers".into()),
            archived: Some(false),
        },
        Purge {
            session: 2,
            expected_generation: 9,
            mode: PurgeMode::Reroot,
        },
        Generate {
            session: 1,
            max_tokens: 256,
        },
        Cancel { session: 1 },
        Subscribe {
            session: 1,
            cursor: 0,
            provisional: true,
        },
        Unsubscribe { sub: 7 },
        Complete {
            prefix: "fn main() {".into(),
            suffix: "}".into(),
            mode: 1,
            max_tokens: 64,
        },
        Fork {
            session: 1,
            at_event: 4,
            params: Some(Params {
                seed: 2,
                ..params()
            }),
        },
        Rebase {
            session: 1,
            edits: vec![
                Edit::Drop { from: 2, to: 3 },
                Edit::Replace {
                    from: 3,
                    to: 9,
                    role: 1,
                    text: "Name four rivers.".into(),
                },
            ],
            params: None,
        },
        Trim {
            session: 1,
            to_event: 3,
        },
        AppendToolResult {
            session: 1,
            call_id: 6,
            content: "rain".into(),
        },
        AppendToolOutcome {
            session: 1,
            call_id: 6,
            outcome: 1,
            note: "timeout".into(),
        },
        RequestToolCancel {
            session: 1,
            call_id: 6,
        },
        OpenToolCalls { session: 1 },
        Ledger { session: 1 },
        RequestPermission {
            session: 1,
            call_id: 6,
            text: "May I?".into(),
        },
        RespondPermission {
            session: 1,
            request_id: 7,
            granted: true,
        },
        SetQos {
            session: 1,
            class: 3,
            batch_invariant: true,
        },
        SetBackgroundRate { divisor: 4 },
        Pin {
            session: 1,
            ttl_ms: 60_000,
        },
        PutMedia {
            bytes: vec![0, 1, 255],
            mime: "image/png".into(),
        },
        GcMedia,
        SetLogLevel {
            directive: "superfluid=debug".into(),
        },
        Metrics,
        SetToolChoice {
            session: 1,
            choice: "required".into(),
        },
        SetOutputFormat {
            session: 1,
            schema: Some(r#"{"type":"object"}"#.into()),
        },
        UseModel {
            model: "SmolLM2-135M-llama3-style".into(),
        },
        Models,
    ]
}

fn response_index(r: &Response) -> u8 {
    use Response::*;
    match r {
        Created { .. } => 0,
        Committed { .. } => 1,
        Events { .. } => 2,
        Sessions { .. } => 3,
        SessionList { .. } => 4,
        Tree { .. } => 5,
        Response::Inspection { .. } => 6,
        Meta { .. } => 7,
        Purged { .. } => 8,
        Delta { .. } => 9,
        Generated { .. } => 10,
        Cancelling => 11,
        Subscribed { .. } => 12,
        SubEvent { .. } => 13,
        SubProvisional { .. } => 14,
        SubEnded { .. } => 15,
        Unsubscribed => 16,
        Completion { .. } => 17,
        Throttled { .. } => 18,
        ToolCalls { .. } => 19,
        Ledger { .. } => 20,
        Ack => 21,
        Pinned { .. } => 22,
        Media { .. } => 23,
        Gc { .. } => 24,
        Text { .. } => 25,
        Err { .. } => 26,
        Models { .. } => 27,
    }
}

fn all_responses() -> Vec<Response> {
    use Response::*;
    let message = event(
        1,
        Record::Message {
            role: Role::User,
            text: "Hi".into(),
            span: vec![1, 2],
        },
    );
    vec![
        Created { session: 1 },
        Committed {
            event: message.clone(),
        },
        Events {
            events: all_records()
                .into_iter()
                .enumerate()
                .map(|(i, r)| event(i as u64, r))
                .collect(),
        },
        Sessions { ids: vec![1, 2, 5] },
        SessionList {
            sessions: vec![SessionSummary {
                session: 2,
                parent: Some(1),
                title: None,
                archived: false,
                events: 6,
                updated_unix_ms: 1_700_000_000_123,
            }],
        },
        Tree {
            nodes: vec![(1, None, None), (2, Some(1), Some(4))],
        },
        Response::Inspection {
            inspection: inspection(),
        },
        Meta { version: 4 },
        Purged {
            sessions: vec![2, 3],
        },
        Delta {
            event: message.clone(),
        },
        Generated {
            events: 3,
            tokens_generated: 42,
            finish: Finish::MaxTokens,
            warm_prefix: 17,
        },
        Cancelling,
        Subscribed { sub: 7 },
        SubEvent {
            sub: 7,
            event: message,
        },
        SubProvisional {
            sub: 7,
            channel: Channel::Reasoning,
            text: "thinking".into(),
        },
        SubEnded {
            sub: 7,
            reason: "publisher closed".into(),
        },
        Unsubscribed,
        Completion {
            text: "println!()".into(),
            tokens: 4,
            cached: 10,
            expired: 0,
        },
        Throttled {
            retry_after_ms: 250,
        },
        ToolCalls {
            calls: vec![(6, "get_weather".into(), r#"{"city":"Paris"}"#.into())],
        },
        Ledger {
            entries: vec![LedgerEntry {
                call_id: 6,
                name: "get_weather".into(),
                arguments: "{}".into(),
                status: LedgerStatus::Answered,
                closed_by: Some(8),
                permission: Some(true),
            }],
        },
        Ack,
        Pinned {
            deadline_unix_ms: 1_700_000_060_000,
        },
        Media {
            hash: "ab12".into(),
        },
        Gc {
            kept: 3,
            removed: 1,
        },
        Text {
            text: "# HELP x\n".into(),
        },
        Err {
            message: "no session 9".into(),
        },
        Models {
            models: vec![superfluid::wire::ModelSummary {
                id: "SmolLM2-135M-Instruct.Q4_1".into(),
                file: "/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
                default: true,
                state: "ready".into(),
            }],
        },
    ]
}

fn inspection() -> Inspection {
    Inspection {
        session: 2,
        parent: Some(1),
        fork_at: Some(4),
        params: params(),
        events: 6,
        tokens: 120,
        generation: 6,
        version: 1,
        title: Some("rivers".into()),
        archived: false,
        purged: false,
        children: vec![3, 4],
        created_unix_ms: 1_700_000_000_000,
        updated_unix_ms: 1_700_000_000_500,
        open_turn: true,
        generating: false,
    }
}

fn record_index(r: &Record) -> u8 {
    use Record::*;
    match r {
        Created { .. } => 0,
        Forked { .. } => 1,
        Rebased { .. } => 2,
        Message { .. } => 3,
        GenerationPrompt { .. } => 4,
        Generated { .. } => 5,
        ToolUse { .. } => 6,
        ToolResult { .. } => 7,
        Appended { .. } => 8,
        ToolParseFailure { .. } => 9,
        EpochBump => 10,
        ToolOutcome { .. } => 11,
        ToolCancelRequested { .. } => 12,
        PermissionRequested { .. } => 13,
        PermissionResponded { .. } => 14,
        Qos { .. } => 15,
        System { .. } => 16,
        Image { .. } => 17,
        Block { .. } => 18,
        ToolChoice { .. } => 19,
        OutputFormat { .. } => 20,
    }
}

fn all_records() -> Vec<Record> {
    use Record::*;
    vec![
        Created {
            parent: None,
            params: params(),
        },
        Forked {
            parent: 1,
            fork_at: 4,
            params: params(),
        },
        Rebased {
            parent: 1,
            fork_at: 2,
            params: params(),
            edits: vec![Edit::Drop { from: 2, to: 3 }],
        },
        Message {
            role: Role::User,
            text: "Hi".into(),
            span: vec![1, 2, 3],
        },
        GenerationPrompt {
            span: vec![151644, 77091, 198],
        },
        Generated {
            span: vec![45, 7598],
            text: "The Nile".into(),
            channel: Channel::Text,
            finish: Finish::EndOfTurn,
        },
        ToolUse {
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        },
        ToolResult {
            call_id: 6,
            content: "rain".into(),
            span: vec![9],
        },
        Appended {
            text: "\n".into(),
            span: vec![198],
        },
        ToolParseFailure {
            text: "<tool_call>{".into(),
            error: "EOF while parsing".into(),
        },
        EpochBump,
        ToolOutcome {
            call_id: 6,
            outcome: superfluid::wire::ToolOutcome::Cancelled,
            note: "cancelled by user".into(),
        },
        ToolCancelRequested { call_id: 6 },
        PermissionRequested {
            call_id: 6,
            text: "May I?".into(),
        },
        PermissionResponded {
            request_id: 13,
            granted: false,
        },
        Qos {
            class: QosClass::Second,
            batch_invariant: false,
        },
        System {
            text: Some("Answer with the tools.".into()),
            tools: vec![r#"{"name":"f"}"#.into()],
            span: vec![1, 2],
        },
        Image {
            role: Role::User,
            blob: "ab12".into(),
            pre_text: "Look:".into(),
            post_text: String::new(),
            span: vec![5; 4],
            image_at: 1,
            image_len: 2,
        },
        Block {
            role: Role::Assistant,
            kind: "thinking".into(),
            payload: "hmm".into(),
            span: vec![7],
        },
        ToolChoice {
            choice: "get_weather".into(),
        },
        OutputFormat { schema: None },
    ]
}

fn log_record_index(r: &LogRecord) -> u8 {
    use LogRecord::*;
    match r {
        Events { .. } => 0,
        Meta { .. } => 1,
        Purge { .. } => 2,
        Boot { .. } => 3,
    }
}

fn all_log_records() -> Vec<LogRecord> {
    use LogRecord::*;
    vec![
        Events {
            session: 1,
            events: all_records()
                .into_iter()
                .enumerate()
                .map(|(i, r)| event(i as u64, r))
                .collect(),
        },
        Meta {
            session: 1,
            version: 2,
            title: None,
            archived: true,
            ts_unix_ms: 1_700_000_000_000,
        },
        Purge {
            session: 2,
            mode: PurgeMode::Cascade,
            sessions: vec![2, 3],
            ts_unix_ms: 1_700_000_000_000,
        },
        Boot {
            epoch: 3,
            ts_unix_ms: 1_700_000_000_000,
        },
    ]
}

#[test]
fn every_request_variant_round_trips() {
    check_variants(&all_requests(), request_index);
}

#[test]
fn every_response_variant_round_trips() {
    check_variants(&all_responses(), response_index);
}

#[test]
fn every_record_variant_round_trips() {
    check_variants(&all_records(), record_index);
    for (i, record) in all_records().into_iter().enumerate() {
        let e = event(i as u64, record.clone());
        round_trip(&e);
        // `Record::name` is the JSON key (or the bare string).
        let v = serde_json::to_value(&record).unwrap();
        let key = match &v {
            Value::String(s) => s.clone(),
            Value::Object(m) => m.keys().next().unwrap().clone(),
            other => panic!("record as {other}"),
        };
        assert_eq!(key, record.name());
    }
}

#[test]
fn every_log_record_variant_round_trips() {
    check_variants(&all_log_records(), log_record_index);
}

#[test]
fn every_purge_mode_and_edit_round_trips() {
    for mode in [PurgeMode::Cascade, PurgeMode::Reroot] {
        round_trip(&mode);
    }
    round_trip(&Edit::Drop { from: 1, to: 2 });
    round_trip(&Edit::Replace {
        from: 1,
        to: u64::MAX,
        role: 0,
        text: "ü".into(),
    });
    round_trip(&inspection());
}

// ---------------------------------------------------------------------------
// Golden postcard bytes

/// Requests whose postcard bytes are pinned below. The first byte of each is
/// the variant's index, so reordering `Request` (or a field) changes them.
fn golden_requests() -> Vec<Request> {
    vec![
        Request::Create {
            parent: None,
            params: params(),
        },
        Request::AppendMessage {
            session: 1,
            role: 1,
            text: "Name three rivers.".into(),
        },
        Request::Tree,
        Request::Purge {
            session: 2,
            expected_generation: 7,
            mode: PurgeMode::Reroot,
        },
        Request::Generate {
            session: 1,
            max_tokens: 256,
        },
        Request::Rebase {
            session: 1,
            edits: vec![
                Edit::Drop { from: 2, to: 3 },
                Edit::Replace {
                    from: 3,
                    to: 9,
                    role: 1,
                    text: "Hi".into(),
                },
            ],
            params: None,
        },
        Request::SetQos {
            session: 1,
            class: 2,
            batch_invariant: true,
        },
        Request::PutMedia {
            bytes: vec![137, 80, 78, 71],
            mime: "image/png".into(),
        },
        Request::Metrics,
    ]
}

/// Written once from the encoding; never edit one to make the test pass:
/// a change here is a change of the socket format.
const GOLDEN_HEX: &[&str] = &[
    "00003333333f3333733f000000000001",
    "020101124e616d65207468726565207269766572732e",
    "09",
    "0c020701",
    "0d018002",
    "1301020002030103090102486900",
    "1c010201",
    "1f0489504e4709696d6167652f706e67",
    "22",
];

#[test]
fn golden_postcard_bytes() {
    let got: Vec<String> = golden_requests()
        .iter()
        .map(|r| hex::encode(to_postcard(r).unwrap()))
        .collect();
    for (request, hex) in golden_requests().iter().zip(&got) {
        eprintln!("{hex:?}, // {request:?}");
    }
    assert_eq!(got.len(), GOLDEN_HEX.len());
    assert_eq!(got, GOLDEN_HEX);
    for (request, hex) in golden_requests().iter().zip(GOLDEN_HEX) {
        let bytes = hex::decode(hex).unwrap();
        assert_eq!(&from_postcard::<Request>(&bytes).unwrap(), request);
    }
}
