//! Logging: env_logger behind a level that `SetLogLevel` can change while
//! the daemon runs. `RUST_LOG` sets the start (default `info`).

use std::sync::OnceLock;

static LOGGER: OnceLock<env_logger::Logger> = OnceLock::new();

struct Dynamic;

impl log::Log for Dynamic {
    fn enabled(&self, m: &log::Metadata) -> bool {
        // llama-cpp-2's tracing spans ("init;", "load_from_file;") are noise.
        let noisy = m.target().starts_with("tracing::") || m.target().starts_with("llama_cpp_2");
        if noisy && m.level() > log::Level::Warn {
            return false;
        }
        m.level() <= log::max_level()
    }
    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            if let Some(inner) = LOGGER.get() {
                inner.log(record);
            }
        }
    }
    fn flush(&self) {
        if let Some(inner) = LOGGER.get() {
            inner.flush();
        }
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

/// Splits a worker log line into its level, target and message.
pub fn parse_worker_line(line: &str) -> Option<(log::Level, &str, &str)> {
    let mut parts = line.splitn(3, '\t');
    let level = parts.next()?.parse().ok()?;
    Some((level, parts.next()?, parts.next()?))
}

fn init_with(worker: bool) {
    use std::io::Write;
    let env = env_logger::Env::default().default_filter_or("info");
    let mut builder = env_logger::Builder::from_env(env);
    let start = builder.build();
    let level = start.filter();
    // The inner logger passes everything: the dynamic level decides.
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
        log::set_max_level(level);
    }
}
