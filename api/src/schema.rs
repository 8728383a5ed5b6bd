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
                "lastTransitionTime": { "type": "string", "format": "date-time", "pattern": TIME_PATTERN, "description": "When the status last changed." },
                "observedGeneration": { "type": "integer", "format": "int64", "description": "The metadata.generation the condition was set for." }
            }
        }
    })
}

/// RFC 3339 times as the operator reads them (k8s-openapi's `Time`, parsed by jiff): at most 9
/// digits of a second, offsets within a day, years to 9998 (jiff's last instant is on
/// 9999-12-30). The API server's `date-time` alone also stores
/// more digits and other offsets, and one such time in a PDEndpoint failed the operator's whole
/// list of them: after its next restart it reconciled no pair again. Every time field of both
/// CRDs carries it.
pub const TIME_PATTERN: &str = r"^([0-8][0-9]{3}|9[0-8][0-9]{2}|99[0-8][0-9]|999[0-8])-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$";

/// An optional RFC 3339 timestamp ([`TIME_PATTERN`]).
pub fn time(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "string", "format": "date-time", "pattern": TIME_PATTERN, "nullable": true })
}

/// A required RFC 3339 timestamp ([`TIME_PATTERN`]).
pub fn time_required(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "string", "format": "date-time", "pattern": TIME_PATTERN })
}

#[cfg(test)]
mod tests {
    use super::TIME_PATTERN;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use proptest::prelude::*;

    fn parses(text: &str) -> bool {
        serde_json::from_value::<Time>(serde_json::Value::String(text.to_owned())).is_ok()
    }

    /// Whether the date a time matching the pattern names exists (the API server's `date-time`
    /// refuses the 31st of a 30-day month; the pattern alone does not).
    fn real_date(text: &str) -> bool {
        let n = |r: std::ops::Range<usize>| text[r].parse::<u32>().expect("digits");
        let (year, month, day) = (n(0..4), n(5..7), n(8..10));
        let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
        let days = match month {
            2 if leap => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        };
        day <= days
    }

    proptest! {
        #[test]
        fn every_time_the_pattern_lets_the_api_server_store_the_operator_reads(
            text in proptest::string::string_regex(TIME_PATTERN.trim_start_matches('^').trim_end_matches('$')).expect("valid regex")
        ) {
            prop_assume!(real_date(&text));
            prop_assert!(parses(&text), "{text}");
        }
    }

    #[test]
    fn every_time_field_of_both_crds_carries_the_pattern() {
        use kube_core::CustomResourceExt;
        fn walk(v: &serde_json::Value, at: &str, found: &mut Vec<String>) {
            match v {
                serde_json::Value::Object(m) => {
                    if m.get("format").and_then(|f| f.as_str()) == Some("date-time") {
                        assert_eq!(m.get("pattern").and_then(|p| p.as_str()), Some(TIME_PATTERN), "{at}");
                        found.push(at.to_owned());
                    }
                    for (k, v) in m {
                        walk(v, &format!("{at}.{k}"), found);
                    }
                }
                serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, at, found)),
                _ => {}
            }
        }
        let mut found = Vec::new();
        for crd in [crate::PDEndpoint::crd(), crate::PDPair::crd()] {
            walk(&serde_json::to_value(crd).expect("json"), "", &mut found);
        }
        for field in ["lastHeartbeat", "lastSuccess", "time", "lastTransitionTime", "since"] {
            assert!(
                found.iter().any(|f| f.ends_with(&format!(".{field}"))),
                "{field} in {found:?}"
            );
        }
    }

    #[test]
    fn times_the_api_servers_date_time_takes_but_the_operator_cannot_read_are_what_the_pattern_is_for() {
        // Both are valid `date-time` to the API server (Go's parser cuts a fraction to 9 digits).
        for text in [
            "2025-01-01T00:00:00.1234567890Z",
            "2025-01-01T00:00:00.123456789123Z",
            "9999-12-31T00:00:00Z",
        ] {
            assert!(!parses(text), "{text}");
        }
        for text in [
            "2025-01-01T00:00:00.123456789Z",
            "2025-01-01T00:00:00+05:30",
            "2025-01-01T23:59:59Z",
        ] {
            assert!(parses(text), "{text}");
        }
    }
}
