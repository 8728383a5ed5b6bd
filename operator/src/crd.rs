//! The CRDs the operator serves, generated from the types in pdpair-api.
//!
//! `crds/` holds the same YAML, committed; `tests/crds.rs` fails when the two differ, and
//! `make crds` rewrites the files.

use kube_core::CustomResourceExt;
use pdpair_api::{PDEndpoint, PDPair};

/// One generated CRD: the file it is committed as, and its YAML.
#[derive(Debug)]
pub struct CrdFile {
    /// File name under `crds/`.
    pub file: &'static str,
    /// The CRD as YAML.
    pub yaml: String,
}

/// Every CRD, in a stable order.
pub fn all() -> Vec<CrdFile> {
    vec![
        CrdFile {
            file: "pdpair.dev_pdpairs.yaml",
            yaml: to_yaml(&int32_bounded(&PDPair::crd())),
        },
        CrdFile {
            file: "pdpair.dev_pdendpoints.yaml",
            yaml: to_yaml(&int32_bounded(&PDEndpoint::crd())),
        },
    ]
}

/// The CRD as JSON with every `format: int32` integer bounded to i32 (`minimum`, `maximum`, where
/// the type sets none). An object the operator cannot read (2147483648 in an i32) would fail its
/// watch's list, read whole, for every object of the kind in every namespace, and such objects
/// can be written past the webhook (an opted-out namespace, `failurePolicy: Ignore`, any
/// PDEndpoint, which no webhook sees). The 1.20 API server here checks the format itself (it
/// refused 3000000000 for `spec.kv.layers` with the bounds left out); the bounds keep that on an
/// API server that does not (kubernetes#136091 reports one).
pub fn int32_bounded<T: serde::Serialize>(crd: &T) -> serde_json::Value {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(o) => {
                let int32 = o.get("type").and_then(|t| t.as_str()) == Some("integer")
                    && o.get("format").and_then(|f| f.as_str()) == Some("int32");
                if int32 {
                    o.entry("minimum").or_insert(i32::MIN.into());
                    o.entry("maximum").or_insert(i32::MAX.into());
                }
                o.values_mut().for_each(walk);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    // Serialising a CRD built from our own types cannot fail: it is plain data with string keys.
    let mut v = serde_json::to_value(crd).expect("a CRD serialises to JSON");
    walk(&mut v);
    v
}

fn to_yaml<T: serde::Serialize>(crd: &T) -> String {
    // Serialising a CRD built from our own types cannot fail: it is plain data with string keys.
    serde_yaml::to_string(crd).expect("a CRD serialises to YAML")
}

/// All CRDs as one multi-document YAML stream, as `pdpair-operator crd` prints it.
pub fn stream() -> String {
    all().iter().map(|c| c.yaml.as_str()).collect::<Vec<_>>().join("---\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_int32_field_of_the_crds_is_bounded_to_i32() {
        let mut checked = 0;
        for crd in super::all() {
            let yaml: serde_yaml::Value = serde_yaml::from_str(&crd.yaml).expect("yaml");
            let mut stack = vec![&yaml];
            while let Some(v) = stack.pop() {
                match v {
                    serde_yaml::Value::Mapping(m) => {
                        if m.get("format").and_then(|f| f.as_str()) == Some("int32") {
                            // Within i32 (a field may bound it tighter: counts from 0, engines
                            // of a Pod to 1024).
                            let bound = |k: &str| m.get(k).and_then(serde_yaml::Value::as_f64);
                            let min = bound("minimum").filter(|x| *x >= f64::from(i32::MIN));
                            let max = bound("maximum").filter(|x| *x <= f64::from(i32::MAX));
                            assert!(min.zip(max).is_some_and(|(min, max)| min <= max), "{m:?}");
                            checked += 1;
                        }
                        stack.extend(m.values());
                    }
                    serde_yaml::Value::Sequence(s) => stack.extend(s.iter()),
                    _ => {}
                }
            }
        }
        assert!(checked >= 20, "{checked} int32 fields");
    }

    #[test]
    fn every_string_and_list_of_a_pdendpoint_is_bounded() {
        // Node agents write PDEndpoints (a compromised node's credentials can, in any
        // namespace), and the operator caches every one and folds their text into PDPair status:
        // the API server must refuse what is too long. Times, enums and patterns bound themselves.
        let crd = super::all()
            .into_iter()
            .find(|c| c.file == "pdpair.dev_pdendpoints.yaml");
        let yaml: serde_yaml::Value = serde_yaml::from_str(&crd.expect("pdendpoints").yaml).expect("yaml");
        let (mut strings, mut lists) = (0, 0);
        let mut stack = vec![&yaml];
        while let Some(v) = stack.pop() {
            match v {
                serde_yaml::Value::Mapping(m) => {
                    let has = |k: &str| m.contains_key(k);
                    match m.get("type").and_then(|t| t.as_str()) {
                        // (A printer column's type is not a schema.)
                        _ if has("jsonPath") => {}
                        Some("string") if !(has("enum") || has("format") || has("pattern")) => {
                            assert!(has("maxLength"), "a string without maxLength: {m:?}");
                            strings += 1;
                        }
                        Some("array") => {
                            assert!(has("maxItems"), "a list without maxItems: {m:?}");
                            lists += 1;
                        }
                        _ => {}
                    }
                    stack.extend(m.values());
                }
                serde_yaml::Value::Sequence(s) => stack.extend(s.iter()),
                _ => {}
            }
        }
        assert!(strings >= 15 && lists >= 4, "{strings} strings, {lists} lists");
    }
}
