//! Logging: env_logger's output behind one filter of env_logger directives
//! (`superfluid::store=debug,info`) that `SetLogLevel` replaces while the
//! daemon runs. `RUST_LOG` sets the start (default `info`); both are parsed
//! by env_logger's own parser (the `env_filter` crate), and a directive it
//! refuses is refused whole: the old filter stays.

use std::sync::{OnceLock, RwLock};

/// The longest directive `SetLogLevel` (or `RUST_LOG`) takes, in bytes,
/// checked before parsing: a directive names a few targets, and its
/// optional `/regex` is compiled for every filter swap.
pub const MAX_DIRECTIVE_BYTES: usize = 1024;

/// The directive when `RUST_LOG` is unset, empty or refused.
const DEFAULT_DIRECTIVE: &str = "info";

/// Formats and writes a record; passes everything, [`FILTER`] decides.
static LOGGER: OnceLock<env_logger::Logger> = OnceLock::new();

/// The directives in force, read for every record that passes
/// `log::max_level`; `None` until [`init`].
static FILTER: RwLock<Option<env_filter::Filter>> = RwLock::new(None);

/// Why a log directive was refused; its text is `SetLogLevel`'s `Err`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirectiveError {
    #[error("log directive is {0} bytes; at most {MAX_DIRECTIVE_BYTES}")]
    TooLong(usize),
    #[error(
        "empty log directive: use a level (error, warn, info, debug, trace, off) \
         or env_logger directives such as \"superfluid::store=debug,info\""
    )]
    Empty,
    #[error(
        "invalid log directive {directive:?}: {reason}; use a level (error, warn, info, debug, \
         trace, off) or env_logger directives such as \"superfluid::store=debug,info\""
    )]
    Invalid { directive: String, reason: String },
}

struct Dynamic;

/// llama-cpp-2's tracing spans ("init;", "load_from_file;") are noise
/// below `warn`, whatever the directives say.
fn noise(m: &log::Metadata) -> bool {
    let noisy = m.target().starts_with("tracing::") || m.target().starts_with("llama_cpp_2");
    noisy && m.level() > log::Level::Warn
}

impl log::Log for Dynamic {
    fn enabled(&self, m: &log::Metadata) -> bool {
        !noise(m) && read_filter().as_ref().is_some_and(|f| f.enabled(m))
    }
    fn log(&self, record: &log::Record) {
        // `matches` is `enabled` plus a directive's `/regex` on the message.
        if noise(record.metadata()) || !read_filter().as_ref().is_some_and(|f| f.matches(record)) {
            return;
        }
        if let Some(inner) = LOGGER.get() {
            inner.log(record);
        }
    }
    fn flush(&self) {
        if let Some(inner) = LOGGER.get() {
            inner.flush();
        }
    }
}

/// A panic while the lock was held cannot leave a half-written `Option`:
/// the poisoned value is still whole.
fn read_filter() -> std::sync::RwLockReadGuard<'static, Option<env_filter::Filter>> {
    FILTER.read().unwrap_or_else(|e| e.into_inner())
}

/// Parses `directive` with env_logger's parser: a level (`debug`), targets
/// with levels (`superfluid::store=debug,warn`), a bare target (that target
/// at `trace`, env_logger's rule), and an optional `/regex` on the message.
/// Refuses an empty directive, one over [`MAX_DIRECTIVE_BYTES`], and any the
/// parser reports an error for (`superfluid=loud`, `===`), naming it.
pub fn parse_directive(directive: &str) -> Result<env_filter::Filter, DirectiveError> {
    if directive.len() > MAX_DIRECTIVE_BYTES {
        return Err(DirectiveError::TooLong(directive.len()));
    }
    // env_logger reads no directive at all as `error`: say so instead.
    if directive.split(',').all(|part| part.trim().is_empty()) {
        return Err(DirectiveError::Empty);
    }
    let mut builder = env_filter::Builder::new();
    match builder.try_parse(directive) {
        Ok(b) => Ok(b.build()),
        Err(e) => Err(DirectiveError::Invalid {
            directive: directive.to_string(),
            reason: e.to_string(),
        }),
    }
}

/// `SetLogLevel`: replaces the filter with `directive`'s, or leaves the old
/// one in force and says why not.
pub fn set_directive(directive: &str) -> Result<(), DirectiveError> {
    install(parse_directive(directive)?);
    Ok(())
}

/// Swaps the filter in, then lets the `log` macros through up to its most
/// verbose directive (they skip the logger entirely above `max_level`).
fn install(filter: env_filter::Filter) {
    let level = filter.filter();
    *FILTER.write().unwrap_or_else(|e| e.into_inner()) = Some(filter);
    log::set_max_level(level);
}

/// The log target of generation stages: `RUST_LOG=superfluid::trace=debug`
/// (and `superfluid::worker=debug` for the worker's) turns them on.
pub const TRACE_TARGET: &str = "superfluid::trace";

/// Logs one stage of a generation's way through the daemon and the worker
/// (`trace <unix µs> <stage> gen=<id>`; `-` where the id is not known
/// there), at debug under [`TRACE_TARGET`]; bench/peer/turn_trace.py reads
/// them. Daemon and worker share the wall clock. Costs one filter check when
/// off.
pub fn stage(stage: &str, gen: &dyn std::fmt::Display) {
    if log::log_enabled!(target: TRACE_TARGET, log::Level::Debug) {
        let us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        log::debug!(target: TRACE_TARGET, "trace {us} {stage} gen={gen}");
    }
}

/// Installs the logger once; later calls do nothing.
pub fn init() {
    init_with(false)
}

/// The worker's logger: one line per record, `LEVEL\ttarget\tmessage`,
/// which the lane parses and logs again in the daemon's own log.
pub fn init_worker() {
    init_with(true)
}

/// The most bytes of one worker stderr line the daemon keeps; the rest is
/// dropped unread into memory and counted.
pub const WORKER_LINE_MAX: usize = 2048;

/// A line the worker wrote to stderr, made safe for the daemon's log: decoded
/// lossily, every control character escaped (the worker can echo client text
/// such as a prompt or a grammar), and `cut` dropped bytes said.
pub fn sanitize_worker_line(bytes: &[u8], cut: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len());
    for c in text.trim_end_matches(['\r', '\n']).chars() {
        if c.is_control() && c != '\t' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if cut > 0 {
        out.push_str(&format!(" …({cut} more bytes cut)"));
    }
    out
}

/// Client text (a request's `model`) as one field of a log line: at most
/// `max_chars` characters, the rest said as `…+N` (N characters cut), and
/// escaped as Rust's `{:?}` escapes a char, whitespace too (a space is
/// `\u{20}`), so that it can neither end the line nor pose as another field.
pub fn log_field(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    for c in chars.by_ref().take(max_chars) {
        if c.is_whitespace() && !c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.extend(c.escape_debug());
        }
    }
    let cut = chars.count();
    if cut > 0 {
        out.push_str(&format!("…+{cut}"));
    }
    out
}

/// Splits a worker log line into its level, target and message.
pub fn parse_worker_line(line: &str) -> Option<(log::Level, &str, &str)> {
    let mut parts = line.splitn(3, '\t');
    let level = parts.next()?.parse().ok()?;
    Some((level, parts.next()?, parts.next()?))
}

/// `RUST_LOG`'s filter, or `info`'s and the reason `RUST_LOG` was refused.
fn start_filter(rust_log: Option<&str>) -> (env_filter::Filter, Option<String>) {
    match rust_log.filter(|d| !d.trim().is_empty()) {
        None => (default_filter(), None),
        Some(d) => match parse_directive(d) {
            Ok(filter) => (filter, None),
            Err(e) => (
                default_filter(),
                Some(format!("RUST_LOG: {e}; logging at info")),
            ),
        },
    }
}

fn default_filter() -> env_filter::Filter {
    parse_directive(DEFAULT_DIRECTIVE).expect("the default directive parses")
}

fn init_with(worker: bool) {
    use std::io::Write;
    let rust_log = std::env::var("RUST_LOG").ok();
    let (filter, refused) = start_filter(rust_log.as_deref());
    // The inner logger passes everything: the dynamic filter decides.
    let mut inner = env_logger::Builder::new();
    inner.filter_level(log::LevelFilter::Trace);
    if worker {
        inner.format(|f, r| {
            let msg = r.args().to_string().replace('\n', " ");
            writeln!(f, "{}\t{}\t{}", r.level(), r.target(), msg)
        });
    } else {
        inner.format_timestamp_millis();
    }
    let inner = inner.build();
    if LOGGER.set(inner).is_ok() && log::set_logger(&Dynamic).is_ok() {
        install(filter);
        if let Some(reason) = refused {
            log::warn!("{reason}");
        }
    }
}

/// A command's stdout failed (`outln!`): a reader that went away (a pipe
/// into `head`) is a quiet end, anything else an error.
pub fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("superfluid: cannot write to stdout: {e}");
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_lines_are_escaped_and_their_cut_said() {
        assert_eq!(
            sanitize_worker_line(b"INFO\tx\tok\r\n", 0),
            "INFO\tx\tok",
            "tabs (the line format) stay"
        );
        assert_eq!(
            sanitize_worker_line(b"a\x1b[31mred\x07\x00", 0),
            "a\\u{1b}[31mred\\u{7}\\u{0}"
        );
        assert_eq!(sanitize_worker_line(b"ok\xff", 0), "ok\u{fffd}");
        assert_eq!(sanitize_worker_line(b"abc", 5), "abc …(5 more bytes cut)");
    }

    #[test]
    fn a_log_field_is_one_field_of_one_line() {
        assert_eq!(
            log_field("SmolLM2-135M.Q4_1:latest", 128),
            "SmolLM2-135M.Q4_1:latest"
        );
        assert_eq!(
            log_field("x\nPOST / 200 model=y\r\t\u{2028}\u{1b}", 128),
            "x\\nPOST\\u{20}/\\u{20}200\\u{20}model=y\\r\\t\\u{2028}\\u{1b}"
        );
        assert_eq!(log_field("a\\b\"", 128), "a\\\\b\\\"");
        assert_eq!(log_field("ééé", 2), "éé…+1");
        assert_eq!(
            log_field(&"m".repeat(300), 128),
            format!("{}…+172", "m".repeat(128))
        );
    }

    use log::{Level, LevelFilter, Metadata};

    fn enabled(f: &env_filter::Filter, target: &str, level: Level) -> bool {
        f.enabled(&Metadata::builder().target(target).level(level).build())
    }

    #[test]
    fn a_plain_level_is_a_global_directive() {
        let f = parse_directive("debug").unwrap();
        assert_eq!(f.filter(), LevelFilter::Debug);
        assert!(enabled(&f, "superfluid::actors::session", Level::Debug));
        assert!(!enabled(&f, "superfluid::store", Level::Trace));
        assert_eq!(parse_directive("off").unwrap().filter(), LevelFilter::Off);
        assert_eq!(
            parse_directive(" WARN ").unwrap().filter(),
            LevelFilter::Warn
        );
    }

    #[test]
    fn per_target_levels_do_not_collapse_into_one() {
        let f = parse_directive("superfluid::store=debug,warn").unwrap();
        assert_eq!(
            f.filter(),
            LevelFilter::Debug,
            "max_level is the most verbose"
        );
        assert!(enabled(&f, "superfluid::store", Level::Debug));
        assert!(enabled(&f, "superfluid::store::wal::writer", Level::Debug));
        assert!(!enabled(&f, "superfluid::store::wal::writer", Level::Trace));
        assert!(!enabled(&f, "superfluid::actors::session", Level::Debug));
        assert!(!enabled(&f, "superfluid::actors::session", Level::Info));
        assert!(enabled(&f, "superfluid::actors::session", Level::Warn));
        // A directive list without a bare level logs nothing elsewhere.
        let only = parse_directive("superfluid::store=info").unwrap();
        assert!(!enabled(&only, "superfluid::http", Level::Error));
    }

    #[test]
    fn garbage_is_refused_naming_the_directive() {
        for bad in [
            "superfluid=loud",
            "===",
            "a=b=c",
            "info/x/y",
            "superfluid::store=debug,x=9",
        ] {
            let e = parse_directive(bad).unwrap_err();
            assert!(
                matches!(&e, DirectiveError::Invalid { directive, .. } if directive == bad),
                "{bad}: {e:?}"
            );
            let text = e.to_string();
            assert!(
                text.starts_with(&format!("invalid log directive {bad:?}")),
                "{text}"
            );
        }
        assert_eq!(parse_directive("").unwrap_err(), DirectiveError::Empty);
        assert_eq!(parse_directive(" , ").unwrap_err(), DirectiveError::Empty);
        assert!(
            parse_directive("info,,").is_ok(),
            "empty parts are skipped, as in RUST_LOG"
        );
    }

    #[test]
    fn the_length_is_capped_before_parsing() {
        let long = "a".repeat(MAX_DIRECTIVE_BYTES + 1);
        let e = parse_directive(&long).unwrap_err();
        assert_eq!(e, DirectiveError::TooLong(long.len()));
        assert_eq!(
            e.to_string(),
            format!("log directive is {} bytes; at most 1024", long.len())
        );
        assert!(parse_directive(&"a".repeat(MAX_DIRECTIVE_BYTES)).is_ok());
    }

    #[test]
    fn rust_log_falls_back_to_info() {
        let (f, why) = start_filter(None);
        assert_eq!((f.filter(), why), (LevelFilter::Info, None));
        let (f, why) = start_filter(Some(""));
        assert_eq!((f.filter(), why), (LevelFilter::Info, None));
        let (f, why) = start_filter(Some("superfluid::store=debug,warn"));
        assert_eq!((f.filter(), why), (LevelFilter::Debug, None));
        assert!(!enabled(&f, "superfluid::http", Level::Info));
        let (f, why) = start_filter(Some("superfluid=loud"));
        assert_eq!(f.filter(), LevelFilter::Info);
        assert!(why.unwrap().contains("\"superfluid=loud\""));
    }

    /// The one test that touches the process-wide filter.
    #[test]
    fn a_refused_directive_leaves_the_old_filter() {
        set_directive("superfluid::store=debug,warn").unwrap();
        assert_eq!(log::max_level(), LevelFilter::Debug);
        assert!(set_directive("superfluid=loud").is_err());
        let now = read_filter();
        let f = now.as_ref().unwrap();
        assert!(enabled(f, "superfluid::store", Level::Debug));
        assert!(!enabled(f, "superfluid::actors", Level::Info));
        drop(now);
        assert_eq!(log::max_level(), LevelFilter::Debug);
    }
}
