//! Tool schemas become grammars off the actor thread, once per tool set.
//! Planning a forced call asks `cached`; a miss answers `Pending` and names
//! the schema, the actor converts it with `convert_off_thread` (a blocking
//! task, within `CONVERT_BUDGET`) and plans again. Results, refusals
//! included, are kept, so a schema that failed or ran out of time is not
//! converted again.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::session::grammar::GrammarError;

/// The most time one schema's conversion may take before the generation is
/// refused (the limits at AppendSystem keep real ones to milliseconds).
pub(super) const CONVERT_BUDGET: Duration = Duration::from_secs(10);
/// The most tool sets remembered; past it the cache starts afresh.
const CAPACITY: usize = 64;

type Cache = HashMap<String, Result<String, GrammarError>>;

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The grammar of `schema` when it was converted before.
pub(super) fn cached(schema: &str) -> Option<Result<String, GrammarError>> {
    let cache = cache().lock().unwrap_or_else(|e| e.into_inner());
    cache.get(schema).cloned()
}

/// The grammar of `schema` (JSON text): from the cache, or converted off
/// the calling thread within `CONVERT_BUDGET` and remembered, so a route
/// that checks a schema before any session is touched also warms what the
/// session's planning reads.
pub(crate) async fn grammar_of(schema: &str) -> Result<String, GrammarError> {
    if let Some(result) = cached(schema) {
        return result;
    }
    convert_off_thread(schema.to_owned(), CONVERT_BUDGET).await;
    cached(schema).unwrap_or(Err(GrammarError::Pending))
}

fn remember(schema: String, result: Result<String, GrammarError>) {
    let mut cache = cache().lock().unwrap_or_else(|e| e.into_inner());
    if cache.len() >= CAPACITY {
        cache.clear();
    }
    cache.insert(schema, result);
}

/// Converts `schema` on a blocking thread and remembers the result; past
/// `budget` the schema is remembered as refused (the thread finishes on
/// its own).
pub(super) async fn convert_off_thread(schema: String, budget: Duration) {
    let key = schema.clone();
    let task = actix_rt::task::spawn_blocking(move || {
        crate::engine::json_schema_grammar(&schema)
            .map_err(|e| GrammarError::Convert(e.to_string()))
    });
    let result = match tokio::time::timeout(budget, task).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(GrammarError::Convert(format!(
            "the schema's grammar could not be built: {e}"
        ))),
        Err(_) => Err(GrammarError::Convert(format!(
            "the schema's grammar took longer than {} s to build",
            budget.as_secs()
        ))),
    };
    remember(key, result);
}
