//! Logging: env_logger behind a level that `SetLogLevel` can change while
//! the daemon runs. `RUST_LOG` sets the start (default `info`).

use std::sync::OnceLock;

static LOGGER: OnceLock<env_logger::Logger> = OnceLock::new();

struct Dynamic;

impl log::Log for Dynamic {
    fn enabled(&self, m: &log::Metadata) -> bool {
        // llama-cpp-2's tracing spans ("init;", "load_from_file;") are noise.
        if m.target().starts_with("tracing::") && m.level() > log::Level::Warn {
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
    let env = env_logger::Env::default().default_filter_or("info");
    let mut builder = env_logger::Builder::from_env(env);
    let start = builder.build();
    let level = start.filter();
    // The inner logger passes everything: the dynamic level decides.
    let inner = env_logger::Builder::new()
        .filter_level(log::LevelFilter::Trace)
        .format_timestamp_millis()
        .build();
    if LOGGER.set(inner).is_ok() && log::set_logger(&Dynamic).is_ok() {
        log::set_max_level(level);
    }
}
