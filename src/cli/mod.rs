//! `superfluid session ...`: scripting a running daemon's session store.
//! Every command is a client of the daemon's unix socket (never of
//! wal.log), prints text for a person, and with `--json` the daemon's
//! replies in the spec's JSON form, one a line. docs/cli.md is the
//! reference.

mod describe;
mod export;

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use superfluid::frontend::socket::Client;
use superfluid::wire::{PurgeMode, Request, Response, SessionId};

/// Look at and script sessions through a running daemon's socket.
#[derive(Args)]
#[command(
    after_help = "Examples:\n  superfluid session ls\n  superfluid session read 7 --follow --json\n  superfluid session export --all --format jsonl --out ./exports"
)]
pub struct SessionArgs {
    #[command(subcommand)]
    command: SessionCommand,
    /// The daemon's socket [default: ~/.superfluid/superfluid.sock]
    #[arg(long, value_name = "PATH", global = true)]
    socket: Option<PathBuf>,
    /// The model whose sessions to work on, on a daemon serving more than
    /// one (`serve --model`): its id, as `UseModel` takes it [default: the
    /// first model]
    #[arg(long, value_name = "ID", global = true)]
    use_model: Option<String>,
}

#[derive(Subcommand)]
enum SessionCommand {
    /// List sessions: id, parent, events, last update, title.
    #[command(after_help = "Example:\n  superfluid session ls --archived --json")]
    Ls {
        /// Archived sessions too (marked `archived`).
        #[arg(long)]
        archived: bool,
        /// Print the daemon's `SessionList` reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the fork tree: each session under its parent, with the event
    /// it was forked at.
    #[command(after_help = "Example:\n  superfluid session tree")]
    Tree {
        /// Print the daemon's `Tree` reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print a session: a summary, then one line per event.
    #[command(after_help = "Example:\n  superfluid session inspect 7 --json")]
    Inspect {
        /// The session id.
        session: SessionId,
        /// Print JSON: the inspection, then the events, one a line.
        #[arg(long)]
        json: bool,
    },
    /// Print a session's events from a cursor on; with --follow, keep
    /// printing new ones as they commit (a subscription) until the session
    /// ends or is purged.
    #[command(
        after_help = "Examples:\n  superfluid session read 7\n  superfluid session read 7 --from 12 --follow --json"
    )]
    Read {
        /// The session id.
        session: SessionId,
        /// The first event id to print.
        #[arg(long, value_name = "CURSOR", default_value_t = 0)]
        from: u64,
        /// Then wait for new events (Subscribe); Ctrl-C stops.
        #[arg(long)]
        follow: bool,
        /// One event a line in its JSON form.
        #[arg(long)]
        json: bool,
    },
    /// Fork a session: a new session holding its events before --at
    /// (all of them without --at). Prints the new id.
    #[command(after_help = "Example:\n  superfluid session fork 7 --at 5")]
    Fork {
        /// The session id.
        session: SessionId,
        /// Keep the parent's events 0 to AT - 1 [default: all of them]
        #[arg(long, value_name = "AT")]
        at: Option<u64>,
        /// Print the daemon's `Created` reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Trim a session to its events before --to: a new session (the
    /// original stays). Prints the new id.
    #[command(after_help = "Example:\n  superfluid session trim 7 --to 3")]
    Trim {
        /// The session id.
        session: SessionId,
        /// Keep events 0 to TO - 1.
        #[arg(long, value_name = "TO")]
        to: u64,
        /// Print the daemon's `Created` reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Archive a session: hidden from `ls` and `tree`, everything kept
    /// (`--undo` shows it again).
    #[command(
        after_help = "Example:\n  superfluid session archive 7\n  superfluid session archive 7 --undo"
    )]
    Archive {
        /// The session id.
        session: SessionId,
        /// Unarchive.
        #[arg(long)]
        undo: bool,
        /// Print the daemon's `Meta` reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Purge a session: gone from every request. Its forks are re-rooted
    /// (kept) unless --cascade. Purge is not erasure: the bytes stay in
    /// the log file.
    #[command(after_help = "Example:\n  superfluid session purge 7 --cascade")]
    Purge {
        /// The session id.
        session: SessionId,
        /// Purge its descendants too.
        #[arg(long)]
        cascade: bool,
        /// Print the daemon's `Purged` reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Export sessions as jsonl or OTLP traces, to files or to an
    /// OTLP/HTTP collector. Content (message and generated text, tool
    /// arguments and results) is left out unless --include-content, and
    /// redacted for known secret shapes when included.
    #[command(
        after_help = "Examples:\n  superfluid session export 7 --format jsonl --out ./exports\n  superfluid session export 7 --format otlp-jsonl --include-content\n  superfluid session export 7 --endpoint http://collector:4318 --include-content --allow-content-egress\n  superfluid session export --all --out ./exports"
    )]
    Export(export::ExportArgs),
}

/// Runs one `superfluid session` command.
pub fn run(args: SessionArgs) -> anyhow::Result<()> {
    let socket = args
        .socket
        .unwrap_or_else(superfluid::daemon::default_socket);
    // The egress refusal comes before anything, the daemon included.
    if let SessionCommand::Export(e) = &args.command {
        e.check()?;
    }
    let mut client = Client::connect(&socket)
        .map_err(|e| anyhow::anyhow!("cannot reach the daemon at {}: {e}", socket.display()))?;
    let c = &mut client;
    if let Some(model) = &args.use_model {
        match c.call(&superfluid::wire::Request::UseModel {
            model: model.clone(),
        })? {
            superfluid::wire::Response::Ack => {}
            superfluid::wire::Response::Err { message } => anyhow::bail!("{message}"),
            other => anyhow::bail!("UseModel answered {other:?}"),
        }
    }
    match args.command {
        SessionCommand::Ls { archived, json } => ls(c, archived, json),
        SessionCommand::Tree { json } => tree(c, json),
        SessionCommand::Inspect { session, json } => describe::inspect(c, session, json),
        SessionCommand::Read {
            session,
            from,
            follow,
            json,
        } => read(c, session, from, follow, json),
        SessionCommand::Fork { session, at, json } => {
            let at_event = match at {
                Some(at) => at,
                None => superfluid::export::inspect(c, session)?.events,
            };
            created(
                c,
                Request::Fork {
                    session,
                    at_event,
                    params: None,
                },
                json,
            )
        }
        SessionCommand::Trim { session, to, json } => created(
            c,
            Request::Trim {
                session,
                to_event: to,
            },
            json,
        ),
        SessionCommand::Archive {
            session,
            undo,
            json,
        } => {
            let i = superfluid::export::inspect(c, session)?;
            let reply = call(
                c,
                Request::SetMeta {
                    session,
                    expected_version: i.version,
                    title: None,
                    archived: Some(!undo),
                },
            )?;
            print_reply(&reply, json, || {
                format!(
                    "session {session} {}",
                    if undo { "unarchived" } else { "archived" }
                )
            })
        }
        SessionCommand::Purge {
            session,
            cascade,
            json,
        } => {
            let i = superfluid::export::inspect(c, session)?;
            let reply = call(
                c,
                Request::Purge {
                    session,
                    expected_generation: i.generation,
                    mode: if cascade {
                        PurgeMode::Cascade
                    } else {
                        PurgeMode::Reroot
                    },
                },
            )?;
            let Response::Purged { sessions } = &reply else {
                anyhow::bail!("unexpected reply to Purge");
            };
            let text = format!(
                "purged {}",
                sessions
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            print_reply(&reply, json, || text)
        }
        SessionCommand::Export(e) => export::run(c, e),
    }
}

/// One request; the daemon's `Err` becomes this command's error.
pub(crate) fn call(client: &mut Client, request: Request) -> anyhow::Result<Response> {
    match client.call(&request).map_err(anyhow::Error::msg)? {
        Response::Err { message } => anyhow::bail!("{message}"),
        r => Ok(r),
    }
}

fn print_reply(reply: &Response, json: bool, text: impl FnOnce() -> String) -> anyhow::Result<()> {
    if json {
        superfluid::outln!("{}", serde_json::to_string(reply)?);
    } else {
        superfluid::outln!("{}", text());
    }
    Ok(())
}

fn created(client: &mut Client, request: Request, json: bool) -> anyhow::Result<()> {
    let reply = call(client, request)?;
    let Response::Created { session } = reply else {
        anyhow::bail!("unexpected reply: {reply:?}");
    };
    print_reply(&reply, json, || session.to_string())
}

fn ls(client: &mut Client, archived: bool, json: bool) -> anyhow::Result<()> {
    let reply = call(
        client,
        Request::Sessions {
            include_archived: archived,
        },
    )?;
    let Response::SessionList { sessions } = &reply else {
        anyhow::bail!("unexpected reply to Sessions");
    };
    if json {
        return print_reply(&reply, true, String::new);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:>8}  {:>8}  {:>7}  {:<24}  TITLE",
        "ID", "PARENT", "EVENTS", "UPDATED"
    )?;
    for s in sessions {
        writeln!(
            out,
            "{:>8}  {:>8}  {:>7}  {:<24}  {}{}",
            s.session,
            s.parent
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            s.events,
            describe::utc(s.updated_unix_ms),
            s.title.as_deref().unwrap_or(""),
            if s.archived { " (archived)" } else { "" },
        )?;
    }
    Ok(())
}

fn tree(client: &mut Client, json: bool) -> anyhow::Result<()> {
    let reply = call(client, Request::Tree)?;
    let Response::Tree { nodes } = &reply else {
        anyhow::bail!("unexpected reply to Tree");
    };
    if json {
        return print_reply(&reply, true, String::new);
    }
    use std::collections::{BTreeMap, BTreeSet};
    let shown: BTreeSet<SessionId> = nodes.iter().map(|n| n.0).collect();
    let mut children: BTreeMap<Option<SessionId>, Vec<(SessionId, Option<u64>)>> = BTreeMap::new();
    for &(id, parent, at) in nodes {
        // A session whose parent is hidden (archived) is shown as a root.
        let p = parent.filter(|p| shown.contains(p));
        children.entry(p).or_default().push((id, at));
    }
    let mut out = std::io::stdout().lock();
    // Depth first without recursion: a chain of forks may be deep.
    let mut stack: Vec<(SessionId, Option<u64>, usize)> = children
        .get(&None)
        .map(|r| r.iter().rev().map(|&(id, at)| (id, at, 0)).collect())
        .unwrap_or_default();
    while let Some((id, at, depth)) = stack.pop() {
        let at = at.map(|a| format!(" (at {a})")).unwrap_or_default();
        writeln!(out, "{}{id}{at}", "  ".repeat(depth))?;
        if let Some(kids) = children.get(&Some(id)) {
            stack.extend(kids.iter().rev().map(|&(k, a)| (k, a, depth + 1)));
        }
    }
    Ok(())
}

fn read(
    client: &mut Client,
    session: SessionId,
    from: u64,
    follow: bool,
    json: bool,
) -> anyhow::Result<()> {
    let print = |e: &superfluid::wire::Event| -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        if json {
            writeln!(out, "{}", serde_json::to_string(e)?)?;
        } else {
            writeln!(out, "{:>6}  {}", e.event_id, describe::describe(&e.body))?;
        }
        // A follower's reader sees each event as it commits.
        out.flush()?;
        Ok(())
    };
    if !follow {
        let Response::Events { events } = call(
            client,
            Request::Read {
                session,
                cursor: from,
            },
        )?
        else {
            anyhow::bail!("unexpected reply to Read");
        };
        for e in &events {
            print(e)?;
        }
        return Ok(());
    }
    // Subscribe sends the backlog from the cursor, then live events.
    let Response::Subscribed { .. } = call(
        client,
        Request::Subscribe {
            session,
            cursor: from,
            provisional: false,
        },
    )?
    else {
        anyhow::bail!("unexpected reply to Subscribe");
    };
    loop {
        match client.read().map_err(anyhow::Error::msg)? {
            Response::SubEvent { event, .. } => print(&event)?,
            Response::SubEnded { reason, .. } => {
                if reason == "lagged" {
                    anyhow::bail!("the subscription ended: lagged (this reader fell behind)");
                }
                eprintln!("superfluid: the subscription ended: {reason}");
                return Ok(());
            }
            Response::Err { message } => anyhow::bail!("{message}"),
            _ => {}
        }
    }
}
