//! The text forms of `session inspect` and `session read`: a summary, one
//! line per event, and times.

use superfluid::frontend::socket::Client;
use superfluid::wire::{Record, Request, Response};

use super::call;

/// A Unix time in ms as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(ms: u64) -> String {
    match jiff::Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX)) {
        Ok(t) => t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string(),
        Err(_) => format!("{ms} ms after the epoch"),
    }
}

pub fn inspect(client: &mut Client, session: u64, json: bool) -> anyhow::Result<()> {
    let Response::Inspection { inspection } = call(client, Request::Inspect { session })? else {
        anyhow::bail!("unexpected reply to Inspect");
    };
    let Response::Events { events } = call(client, Request::Read { session, cursor: 0 })? else {
        anyhow::bail!("unexpected reply to Read");
    };
    if json {
        superfluid::outln!("{}", serde_json::to_string(&inspection)?);
        for e in &events {
            superfluid::outln!("{}", serde_json::to_string(e)?);
        }
        return Ok(());
    }
    let i = &inspection;
    superfluid::outln!(
        "session {}{}{}: {} events, {} tokens, generation {}, version {}{}{}",
        i.session,
        i.parent.map(|p| format!(" (from {p}")).unwrap_or_default(),
        match (i.parent, i.fork_at) {
            (Some(_), Some(at)) => format!(" at {at})"),
            (Some(_), None) => ")".into(),
            _ => String::new(),
        },
        i.events,
        i.tokens,
        i.generation,
        i.version,
        i.title
            .as_ref()
            .map(|t| format!(", title {t:?}"))
            .unwrap_or_default(),
        if i.archived { ", archived" } else { "" },
    );
    for e in &events {
        superfluid::outln!("{:>6}  {}", e.event_id, describe(&e.body));
    }
    Ok(())
}

/// One line about a record.
pub fn describe(r: &Record) -> String {
    const MAX: usize = 80;
    let short = |s: &str| {
        let one: String = s.replace('\n', "\\n");
        if one.chars().count() > MAX {
            format!("{:?}…", one.chars().take(MAX).collect::<String>())
        } else {
            format!("{one:?}")
        }
    };
    let role = |r: &superfluid::wire::Role| r.name();
    match r {
        Record::Created { parent, .. } => match parent {
            Some(p) => format!("Created under session {p}"),
            None => "Created".into(),
        },
        Record::Forked {
            parent, fork_at, ..
        } => format!("Forked from session {parent} at {fork_at}"),
        Record::Rebased {
            parent,
            fork_at,
            edits,
            ..
        } => {
            format!(
                "Rebased from session {parent} at {fork_at}, {} edits",
                edits.len()
            )
        }
        Record::Message {
            role: r,
            text,
            span,
        } => {
            format!(
                "Message {} {} ({} tokens)",
                role(r),
                short(text),
                span.len()
            )
        }
        Record::Generated {
            text,
            channel,
            finish,
            span,
        } => format!(
            "Generated ch{} finish {} {} ({} tokens)",
            u8::from(*channel),
            u8::from(*finish),
            short(text),
            span.len()
        ),
        Record::ToolUse { name, arguments } => format!("ToolUse {name} {}", short(arguments)),
        Record::ToolResult {
            call_id, content, ..
        } => {
            format!("ToolResult for {call_id} {}", short(content))
        }
        Record::Appended { text, span } => {
            format!("Appended {} ({} tokens)", short(text), span.len())
        }
        Record::System { text, tools, span } => format!(
            "System {} with {} tools ({} tokens)",
            short(text.as_deref().unwrap_or("")),
            tools.len(),
            span.len()
        ),
        other => format!(
            "{} {}",
            other.name(),
            serde_json::to_string(other).unwrap_or_default()
        ),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_is_the_calendar() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(super::utc(1_764_592_496_000), "2025-12-01 12:34:56 UTC");
        assert_eq!(super::utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }
}
