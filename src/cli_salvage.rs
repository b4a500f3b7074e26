//! `superfluid salvage`: cut a damaged `wal.log` at a named offset (see
//! `superfluid::store::salvage`), after showing what it will do and asking.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use superfluid::store::salvage;

#[derive(clap::Args)]
pub struct Salvage {
    /// The sessions directory holding wal.log [default: ~/.superfluid/sessions]
    #[arg(long, value_name = "DIR")]
    sessions: Option<PathBuf>,
    /// Cut the log here: the byte offset a corruption error named (it must
    /// be a record or group boundary with only intact records before it).
    #[arg(long, value_name = "OFFSET")]
    truncate_at: u64,
    /// Do not ask for confirmation (for scripts).
    #[arg(long)]
    yes: bool,
}

pub fn run(s: Salvage) -> anyhow::Result<()> {
    let dir = s
        .sessions
        .unwrap_or_else(superfluid::daemon::default_sessions_dir);
    let plan = salvage::plan(&dir, s.truncate_at)?;
    superfluid::outln!(
        "{}: version {}, {} bytes. Cutting at byte offset {} keeps {} records and drops {} bytes \
         (copied first to {}.salvaged.<time>).",
        plan.path.display(),
        plan.version,
        plan.file_len,
        plan.offset,
        plan.records_kept,
        plan.dropped(),
        plan.path.display()
    );
    if !s.yes {
        print!("Type 'yes' to cut the log: ");
        std::io::stdout().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        if answer.trim() != "yes" {
            anyhow::bail!("not confirmed; the log is unchanged");
        }
    }
    match plan.apply()? {
        Some(kept) => superfluid::outln!("done; the dropped bytes are in {}", kept.display()),
        None => superfluid::outln!("done; nothing was past the offset"),
    }
    Ok(())
}
