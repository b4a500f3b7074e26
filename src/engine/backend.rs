//! The process-wide llama.cpp backend, and llama.cpp/ggml log output routed into the `log` crate.
//!
//! llama.cpp prints ~2,300 lines to stderr per model load unless a log callback is installed, and
//! it sends line *fragments* (a message may arrive in several calls, continuations flagged with
//! `GGML_LOG_LEVEL_CONT`). [`install_log_callback`] registers a C callback with both `llama_log_set`
//! and `ggml_log_set` that buffers fragments until a newline and forwards whole lines to `log`
//! (target `llama.cpp` or `ggml`) with the levels error->error, warn->warn, info->debug,
//! debug->trace. [`backend`] installs it before its first llama.cpp call.

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, Once, OnceLock};

use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_sys_2::{
    ggml_log_level, GGML_LOG_LEVEL_CONT, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_ERROR,
    GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN,
};

use super::EngineError;

/// The llama.cpp backend, initialised once per process (llama-cpp-2 refuses a second `init`).
///
/// The log callback is installed before the backend is initialised, so no llama.cpp output reaches
/// stderr.
pub fn backend() -> Result<&'static LlamaBackend, EngineError> {
    static BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            install_log_callback();
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| EngineError::Backend(e.clone()))
}

/// Route llama.cpp's and ggml's log output into the `log` crate (idempotent; cheap after the
/// first call). [`backend`] calls it; call it yourself before any other llama.cpp entry point.
pub fn install_log_callback() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let llama: *const LogSink = &LLAMA_SINK;
        let ggml: *const LogSink = &GGML_SINK;
        // SAFETY: the callback is a plain `extern "C"` function that never unwinds, and the user
        // data points to statics that live for the whole process. `llama_log_set` also resets
        // ggml's callback, so ggml's is set second.
        unsafe {
            llama_cpp_sys_2::llama_log_set(Some(log_callback), llama.cast_mut().cast());
            llama_cpp_sys_2::ggml_log_set(Some(log_callback), ggml.cast_mut().cast());
        }
    });
}

/// One log source (llama.cpp or ggml), with its buffered partial line.
struct LogSink {
    target: &'static str,
    state: Mutex<LineBuffer>,
}

struct LineBuffer {
    /// The level of the line being assembled (used for `CONT` fragments).
    level: ggml_log_level,
    partial: String,
    /// Bytes of the pending line cut off past [`LOG_LINE_MAX`].
    dropped: usize,
}

/// The most of one llama.cpp log line that is logged: it logs what a
/// request sent (a grammar it refuses, a regex pattern whole), and one
/// 10 MB schema would be a 10 MB log line (and a 10 MB buffer until its
/// newline).
const LOG_LINE_MAX: usize = 2048;

impl LineBuffer {
    /// Appends a fragment; returns every line it completed (level, text),
    /// each cut at [`LOG_LINE_MAX`] bytes with a note of what was cut.
    fn push(&mut self, level: ggml_log_level, text: &str) -> Vec<(ggml_log_level, String)> {
        let mut out = Vec::new();
        if level != GGML_LOG_LEVEL_CONT {
            if level != self.level && !self.partial.is_empty() {
                // A new message at another level while a line is pending: flush the pending one.
                out.push((self.level, self.take_line(self.partial.len())));
            }
            self.level = level;
        }
        self.partial.push_str(text);
        while let Some(nl) = self.partial.find('\n') {
            let line = self.take_line(nl + 1);
            out.push((self.level, line.trim_end_matches(['\n', '\r']).to_string()));
        }
        if self.partial.len() > LOG_LINE_MAX {
            let cut = floor_char_boundary(&self.partial, LOG_LINE_MAX);
            self.dropped += self.partial.len() - cut;
            self.partial.truncate(cut);
        }
        out
    }

    /// The first `n` bytes of the pending text as a line, cut to the cap.
    fn take_line(&mut self, n: usize) -> String {
        let mut line: String = self.partial.drain(..n).collect();
        let mut dropped = std::mem::take(&mut self.dropped);
        if line.len() > LOG_LINE_MAX {
            let cut = floor_char_boundary(&line, LOG_LINE_MAX);
            dropped += line.len() - cut;
            line.truncate(cut);
        }
        if dropped > 0 {
            let end = line.trim_end_matches(['\n', '\r']).len();
            line.truncate(end);
            line.push_str(&format!("... ({dropped} more bytes not logged)"));
        }
        line
    }
}

/// The largest char boundary of `s` at or below `at`.
fn floor_char_boundary(s: &str, at: usize) -> usize {
    (0..=at.min(s.len()))
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

static LLAMA_SINK: LogSink = LogSink::new("llama.cpp");
static GGML_SINK: LogSink = LogSink::new("ggml");

impl LogSink {
    const fn new(target: &'static str) -> Self {
        Self {
            target,
            state: Mutex::new(LineBuffer {
                level: GGML_LOG_LEVEL_INFO,
                partial: String::new(),
                dropped: 0,
            }),
        }
    }

    /// Append a fragment and emit every completed line.
    fn push(&self, level: ggml_log_level, text: &str) {
        let lines = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(level, text);
        for (level, line) in lines {
            emit(self.target, level, &line);
        }
    }
}

/// Map a ggml level to a `log` level: error->error, warn->warn, info->debug, debug (and
/// anything else) ->trace.
fn map_level(level: ggml_log_level) -> log::Level {
    match level {
        GGML_LOG_LEVEL_ERROR => log::Level::Error,
        GGML_LOG_LEVEL_WARN => log::Level::Warn,
        GGML_LOG_LEVEL_INFO => log::Level::Debug,
        GGML_LOG_LEVEL_DEBUG => log::Level::Trace,
        _ => log::Level::Trace,
    }
}

fn emit(target: &str, level: ggml_log_level, line: &str) {
    if line.trim().is_empty() {
        return;
    }
    log::log!(target: target, map_level(level), "{line}");
}

unsafe extern "C" fn log_callback(level: ggml_log_level, text: *const c_char, user: *mut c_void) {
    if text.is_null() || user.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for the duration of the call; `user`
    // is one of the `LogSink` statics registered in `install_log_callback`.
    let (text, sink) = unsafe {
        (
            CStr::from_ptr(text),
            &*(user.cast_const().cast::<LogSink>()),
        )
    };
    let text = text.to_string_lossy();
    // A panic must not unwind into C (that aborts); a misbehaving logger loses the line instead.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink.push(level, &text)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_log_line_is_cut_with_a_note() {
        let mut b = LineBuffer {
            level: GGML_LOG_LEVEL_INFO,
            partial: String::new(),
            dropped: 0,
        };
        // A 100 KB line in fragments, its newline in the last one.
        assert!(b.push(GGML_LOG_LEVEL_ERROR, "parse: ").is_empty());
        for _ in 0..100 {
            assert!(b.push(GGML_LOG_LEVEL_CONT, &"é".repeat(500)).is_empty());
            assert!(b.partial.len() <= LOG_LINE_MAX);
        }
        let lines = b.push(GGML_LOG_LEVEL_CONT, "end\nnext ");
        assert_eq!(lines.len(), 1);
        let (level, line) = &lines[0];
        assert_eq!(*level, GGML_LOG_LEVEL_ERROR);
        assert!(line.starts_with("parse: éé"), "{}", &line[..20]);
        let total = 7 + 100 * 500 * 2 + 3;
        let note = format!("... ({} more bytes not logged)", total - (LOG_LINE_MAX - 1));
        assert!(line.ends_with(&note), "{}", &line[line.len() - 60..]);
        assert!(line.len() <= LOG_LINE_MAX + note.len());
        // Short lines pass whole.
        assert_eq!(
            b.push(GGML_LOG_LEVEL_CONT, "line\n"),
            vec![(GGML_LOG_LEVEL_ERROR, "next line".to_string())]
        );
    }

    #[test]
    fn backend_is_initialised_once() {
        let a = backend().expect("backend") as *const LlamaBackend;
        let b = backend().expect("backend") as *const LlamaBackend;
        assert_eq!(a, b);
    }

    /// Counts the records llama.cpp/ggml send through `log`.
    struct Counter {
        lines: std::sync::atomic::AtomicUsize,
        partial: std::sync::atomic::AtomicUsize,
    }

    impl log::Log for Counter {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &log::Record<'_>) {
            use std::sync::atomic::Ordering::Relaxed;
            if matches!(record.target(), "llama.cpp" | "ggml") {
                self.lines.fetch_add(1, Relaxed);
                if record.args().to_string().contains('\n') {
                    self.partial.fetch_add(1, Relaxed);
                }
            }
        }
        fn flush(&self) {}
    }

    #[test]
    fn model_load_logs_go_to_the_log_crate() {
        use std::sync::atomic::Ordering::Relaxed;
        static COUNTER: Counter = Counter {
            lines: std::sync::atomic::AtomicUsize::new(0),
            partial: std::sync::atomic::AtomicUsize::new(0),
        };
        if log::set_logger(&COUNTER).is_err() {
            return; // another logger is installed; nothing to observe
        }
        log::set_max_level(log::LevelFilter::Trace);
        let path = crate::engine::vocab::tests::model();
        let path = path.as_path();
        let before = COUNTER.lines.load(Relaxed);
        let _vocab = crate::engine::vocab::Vocab::load(path).expect("load");
        let lines = COUNTER.lines.load(Relaxed) - before;
        assert!(lines > 20, "only {lines} llama.cpp log lines were routed");
        assert_eq!(
            COUNTER.partial.load(Relaxed),
            0,
            "records must be single lines"
        );
    }

    #[test]
    fn fragments_are_assembled_into_lines() {
        let sink = LogSink::new("test");
        sink.push(GGML_LOG_LEVEL_INFO, "load: part one");
        assert_eq!(sink.state.lock().unwrap().partial, "load: part one");
        sink.push(GGML_LOG_LEVEL_CONT, ", part two\nnext");
        assert_eq!(sink.state.lock().unwrap().partial, "next");
        assert_eq!(sink.state.lock().unwrap().level, GGML_LOG_LEVEL_INFO);
        sink.push(GGML_LOG_LEVEL_WARN, "warning\n");
        let st = sink.state.lock().unwrap();
        assert!(st.partial.is_empty());
        assert_eq!(st.level, GGML_LOG_LEVEL_WARN);
    }

    #[test]
    fn levels_map_as_documented() {
        assert_eq!(map_level(GGML_LOG_LEVEL_ERROR), log::Level::Error);
        assert_eq!(map_level(GGML_LOG_LEVEL_WARN), log::Level::Warn);
        assert_eq!(map_level(GGML_LOG_LEVEL_INFO), log::Level::Debug);
        assert_eq!(map_level(GGML_LOG_LEVEL_DEBUG), log::Level::Trace);
    }
}
