//! The models a daemon serves (`serve MODEL [--model MODEL]...`): each with
//! its own log, lane and registry. The first is the default: every socket
//! and WebSocket connection starts on it, and `UseModel` moves one to
//! another; the HTTP routes pick by their `model` field.

use std::path::PathBuf;
use std::sync::Arc;

use actix::Addr;

use super::registry::Registry;
use super::Shared;
use crate::wire::ModelSummary;

/// One served model.
#[derive(Clone)]
pub struct ServedModel {
    /// Its id: the GGUF's file stem, e.g. `SmolLM2-135M-Instruct.Q4_1`.
    pub id: String,
    pub file: PathBuf,
    pub shared: Shared,
    pub registry: Addr<Registry>,
}

impl ServedModel {
    /// Whether `name` names it: its id, or its file name.
    pub fn answers_to(&self, name: &str) -> bool {
        name == self.id || name == format!("{}.gguf", self.id)
    }
}

/// Every served model, the default first.
#[derive(Clone)]
pub struct Served(Arc<Vec<ServedModel>>);

impl Served {
    /// `models` must hold at least one.
    pub fn new(models: Vec<ServedModel>) -> Served {
        assert!(!models.is_empty(), "a daemon serves at least one model");
        Served(Arc::new(models))
    }

    pub fn default_model(&self) -> &ServedModel {
        &self.0[0]
    }

    pub fn all(&self) -> &[ServedModel] {
        &self.0
    }

    /// The index of the model `name` names: an id, a file name, or
    /// "default" (the first).
    pub fn position(&self, name: &str) -> Option<usize> {
        if name == "default" {
            return Some(0);
        }
        self.0.iter().position(|m| m.answers_to(name))
    }

    /// The model `name` names (see [`position`](Self::position)).
    pub fn find(&self, name: &str) -> Option<&ServedModel> {
        self.position(name).map(|i| &self.0[i])
    }

    /// The ids, for messages.
    pub fn ids(&self) -> Vec<String> {
        self.0.iter().map(|m| m.id.clone()).collect()
    }

    /// The Err for a name that names none.
    pub fn unknown(&self, name: &str) -> String {
        format!(
            "the model {name:?} is not served here; this daemon serves {:?} (the first is \
             \"default\")",
            self.ids()
        )
    }

    /// `Models`' answer.
    pub fn summaries(&self) -> Vec<ModelSummary> {
        self.0
            .iter()
            .enumerate()
            .map(|(i, m)| ModelSummary {
                id: m.id.clone(),
                file: m.file.display().to_string(),
                default: i == 0,
                state: m.shared.lane.borrow().name().to_string(),
            })
            .collect()
    }
}
