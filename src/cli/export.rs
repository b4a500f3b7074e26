//! `superfluid session export`: the command around `superfluid::export`.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use superfluid::export::{self, ExportOptions};
use superfluid::frontend::socket::Client;
use superfluid::wire::{Request, Response, SessionId};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// One line per event: `session-<id>.jsonl`.
    Jsonl,
    /// One OTLP/JSON `ExportTraceServiceRequest` per session, one a line:
    /// `session-<id>.otlp.jsonl`.
    OtlpJsonl,
}

#[derive(Args)]
pub struct ExportArgs {
    /// The sessions to export.
    #[arg(
        value_name = "SESSION",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    sessions: Vec<SessionId>,
    /// Every session, archived ones included (archiving hides, it keeps).
    #[arg(long)]
    all: bool,
    /// The file format [default: jsonl]
    #[arg(long, value_enum, conflicts_with = "endpoint")]
    format: Option<Format>,
    /// The directory the files go to, created if missing [default: .]
    #[arg(long, value_name = "DIR", conflicts_with = "endpoint")]
    out: Option<PathBuf>,
    /// Push OTLP traces to this OTLP/HTTP collector (JSON bodies, POST
    /// URL/v1/traces; http:// only) instead of writing files.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// Include content (message and generated text, tool arguments and
    /// results, tool definitions), redacted for known secret shapes.
    #[arg(long)]
    include_content: bool,
    /// Allow --include-content with --endpoint: content leaves the machine.
    #[arg(long)]
    allow_content_egress: bool,
    /// The most bytes one pushed request body takes: a session's spans are
    /// split over several requests to stay under it (with --endpoint).
    #[arg(long, value_name = "BYTES", default_value_t = export::otlp::MAX_REQUEST_BYTES,
          value_parser = clap::value_parser!(usize))]
    max_request_bytes: usize,
    /// The model's name for gen_ai.request.model (the daemon does not
    /// report which file it serves).
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
}

impl ExportArgs {
    /// What is refused before the daemon is asked anything.
    pub fn check(&self) -> anyhow::Result<()> {
        if let Some(endpoint) = &self.endpoint {
            export::check_egress(endpoint, self.include_content, self.allow_content_egress)?;
            export::traces_url(endpoint)?;
        }
        Ok(())
    }
}

fn session_ids(client: &mut Client, args: &ExportArgs) -> anyhow::Result<Vec<SessionId>> {
    if !args.all {
        return Ok(args.sessions.clone());
    }
    match super::call(
        client,
        Request::Sessions {
            include_archived: true,
        },
    )? {
        Response::SessionList { sessions } => Ok(sessions.iter().map(|s| s.session).collect()),
        _ => anyhow::bail!("unexpected reply to Sessions"),
    }
}

/// Creates `path` readable by its owner only: an export may hold every
/// conversation's text. A file there already is replaced by a new one (not
/// truncated: whoever had the old one open, readable by others, would read
/// the export through it), and a link there is refused, not followed (in a
/// shared directory, another user's link would send the export to a file
/// of their choosing).
fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(std::io::Error::other(format!(
                "{} is a symbolic link; an export is not written through one",
                path.display()
            )))
        }
        Ok(_) => std::fs::remove_file(path)?,
        Err(_) => {}
    }
    // create_new: a file or link made there meanwhile fails the export.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

pub fn run(client: &mut Client, args: ExportArgs) -> anyhow::Result<()> {
    let ids = session_ids(client, &args)?;
    let opts = ExportOptions {
        include_content: args.include_content,
        model: args.model.clone(),
    };
    let url = args
        .endpoint
        .as_deref()
        .map(export::traces_url)
        .transpose()?;
    let out_dir = args.out.clone().unwrap_or_else(|| PathBuf::from("."));
    if url.is_none() {
        std::fs::create_dir_all(&out_dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", out_dir.display()))?;
    }
    // Drawn on stderr, and only when it is a terminal (indicatif's rule).
    let bar = indicatif::ProgressBar::new(ids.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} sessions {msg}")
            .map_err(anyhow::Error::msg)?,
    );
    let mut redactions = 0usize;
    for id in ids {
        bar.set_message(format!("session {id}"));
        let s = export::fetch(client, id)?;
        match (&url, args.format.unwrap_or(Format::Jsonl)) {
            (Some(url), _) => {
                let (body, n) = export::otlp::request(&s, &opts);
                redactions += n;
                for part in export::otlp::split(&body, args.max_request_bytes)? {
                    export::push(url, &part)?;
                }
            }
            (None, Format::Jsonl) => {
                let path = out_dir.join(format!("session-{id}.jsonl"));
                let mut f = std::io::BufWriter::new(create_private(&path)?);
                let (lines, n) = export::jsonl::lines(&s, &opts);
                redactions += n;
                for line in lines {
                    writeln!(f, "{line}")?;
                }
                f.flush()?;
            }
            (None, Format::OtlpJsonl) => {
                let path = out_dir.join(format!("session-{id}.otlp.jsonl"));
                let (body, n) = export::otlp::request(&s, &opts);
                redactions += n;
                let mut f = create_private(&path)?;
                writeln!(f, "{body}")?;
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if redactions > 0 {
        eprintln!("superfluid: secrets redacted: {redactions}");
    }
    Ok(())
}
