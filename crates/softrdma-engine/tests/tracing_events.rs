//! The engine reports QP state changes as `tracing` events.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Collects the fields of every event as text.
#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<String>>>);

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", field.name(), value));
    }
}

impl Subscriber for Collect {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut t = Text(String::new());
        event.record(&mut t);
        self.0.lock().unwrap().push(t.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn disconnect_reports_the_state_change() {
    let p = pair(false);
    let collect = Collect::default();
    tracing::subscriber::with_default(collect.clone(), || {
        p.a.qp.disconnect().unwrap();
    });
    let events = collect.0.lock().unwrap().clone();
    let qp = p.a.qp.qp_num();
    assert!(
        events.iter().any(|e| e.contains("QP state change")
            && e.contains(&format!("qp={qp} "))
            && e.contains("from=RTS")
            && e.contains("to=CLOSING")),
        "{events:?}"
    );
}
