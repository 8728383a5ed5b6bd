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
            yaml: to_yaml(&PDPair::crd()),
        },
        CrdFile {
            file: "pdpair.dev_pdendpoints.yaml",
            yaml: to_yaml(&PDEndpoint::crd()),
        },
    ]
}

fn to_yaml<T: serde::Serialize>(crd: &T) -> String {
    // Serialising a CRD built from our own types cannot fail: it is plain data with string keys.
    serde_yaml::to_string(crd).expect("a CRD serialises to YAML")
}

/// All CRDs as one multi-document YAML stream, as `pdpair-operator crd` prints it.
pub fn stream() -> String {
    all().iter().map(|c| c.yaml.as_str()).collect::<Vec<_>>().join("---\n")
}
