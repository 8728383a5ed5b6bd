//! Hand-written schemas for the few fields whose derived schema does not suit a CRD.

use schemars::{Schema, SchemaGenerator, json_schema};

/// A pod template, kept whole: the full core/v1 schema would make the CRD too large for
/// client-side `kubectl apply` (its last-applied annotation is capped at 256 KiB). The operator
/// deserialises it as a PodTemplateSpec, and the API server validates it in the Deployment.
pub fn pod_template(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// Standard Kubernetes conditions as a list-map keyed by type, so server-side apply merges them
/// per condition.
pub fn conditions(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["type", "status", "lastTransitionTime", "reason", "message"],
            "properties": {
                "type": { "type": "string", "description": "Condition type." },
                "status": { "type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown." },
                "reason": { "type": "string", "description": "PascalCase reason for the last transition." },
                "message": { "type": "string", "description": "Human-readable detail." },
                "lastTransitionTime": { "type": "string", "format": "date-time", "description": "When the status last changed." },
                "observedGeneration": { "type": "integer", "format": "int64", "description": "The metadata.generation the condition was set for." }
            }
        }
    })
}

/// An optional RFC 3339 timestamp.
pub fn time(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "string", "format": "date-time", "nullable": true })
}

/// A required RFC 3339 timestamp.
pub fn time_required(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "string", "format": "date-time" })
}
