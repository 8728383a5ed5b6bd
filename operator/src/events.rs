//! Events (events.k8s.io/v1), one object per occurrence.
//!
//! kube's `Recorder` folds events with the same reason and action into a series that keeps the
//! first note; a user who fixes one violation and meets the next would then read a stale message.
//! Rejections and transitions are rare, so each gets its own Event.

use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, Client, api::PostParams};

/// The controller name events are reported under.
pub const REPORTING_CONTROLLER: &str = "pdpair.dev/operator";
/// Events' notes are capped at 1 KiB by the API server.
const NOTE_MAX: usize = 1024;

/// Publishes events for one operator replica.
#[derive(Clone)]
pub struct Publisher {
    client: Client,
    instance: String,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("instance", &self.instance).finish()
    }
}

/// Normal or Warning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Informational.
    Normal,
    /// Something needs attention.
    Warning,
}

impl Publisher {
    /// A publisher reporting as `instance` (the replica's identity).
    pub fn new(client: Client, instance: String) -> Publisher {
        Publisher { client, instance }
    }

    /// Creates one Event about `regarding`. Failures are logged, never fatal: an Event is a
    /// courtesy, the condition or the admission response is the record.
    pub async fn publish(&self, regarding: &ObjectReference, kind: Kind, reason: &str, action: &str, note: &str) {
        let namespace = regarding.namespace.clone().unwrap_or_else(|| "default".into());
        let mut suffix = [0u8; 6];
        let _ = getrandom::fill(&mut suffix);
        let suffix: String = suffix.iter().map(|b| format!("{b:02x}")).collect();
        let base = regarding.name.clone().unwrap_or_else(|| "pdpair".into());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(format!("{base}.{suffix}")),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(Timestamp::now())),
            type_: Some(match kind {
                Kind::Normal => "Normal".into(),
                Kind::Warning => "Warning".into(),
            }),
            reason: Some(reason.into()),
            action: Some(action.into()),
            note: Some(truncate(note)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(REPORTING_CONTROLLER.into()),
            reporting_instance: Some(self.instance.clone()),
            ..Event::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        if let Err(e) = api.create(&PostParams::default(), &event).await {
            tracing::warn!(error = %e, reason, "could not publish an Event");
        }
    }
}

fn truncate(note: &str) -> String {
    if note.len() <= NOTE_MAX {
        return note.to_owned();
    }
    let mut end = NOTE_MAX - 3;
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &note[..end])
}

#[cfg(test)]
mod tests {
    #[test]
    fn truncates_long_notes_on_a_char_boundary() {
        let long = "é".repeat(1000);
        let t = super::truncate(&long);
        assert!(t.len() <= super::NOTE_MAX && t.ends_with("..."));
        assert_eq!(super::truncate("short"), "short");
    }
}
