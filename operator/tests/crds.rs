//! The committed CRDs under `crds/` must equal what the types generate.
//! `make crds` (UPDATE_CRDS=1) rewrites them.

use std::path::PathBuf;

#[test]
fn committed_crds_match_the_types() {
    // crds/ and the Helm chart's crds/ hold the same files.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let update = std::env::var_os("UPDATE_CRDS").is_some();
    for dir in [root.join("crds"), root.join("charts/pdpair/crds")] {
        for crd in pdpair_operator::crd::all() {
            let path = dir.join(crd.file);
            if update {
                std::fs::write(&path, &crd.yaml).expect("write the CRD file");
                continue;
            }
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                committed == crd.yaml,
                "{} differs from the CRD the types generate; run `make crds` and commit the result",
                path.display()
            );
        }
        let files = std::fs::read_dir(&dir).expect("CRD dir").count();
        assert_eq!(
            files,
            pdpair_operator::crd::all().len(),
            "{} holds files that are not generated CRDs",
            dir.display()
        );
    }
}

#[test]
fn crd_has_the_declared_names_columns_and_status() {
    let yaml = &pdpair_operator::crd::all()[0].yaml;
    let crd: serde_yaml::Value = serde_yaml::from_str(yaml).expect("CRD YAML parses");
    let spec = &crd["spec"];
    assert_eq!(spec["group"].as_str(), Some("pdpair.dev"));
    assert_eq!(spec["scope"].as_str(), Some("Namespaced"));
    assert_eq!(spec["names"]["shortNames"][0].as_str(), Some("pdp"));
    let version = &spec["versions"][0];
    assert_eq!(version["name"].as_str(), Some("v1alpha1"));
    assert!(version["subresources"]["status"].is_mapping());
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_sequence()
        .expect("printer columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(
        columns,
        ["Mode", "Prefill", "Decode", "Compatible", "Ready", "Path", "Age"]
    );
    let schema = &version["schema"]["openAPIV3Schema"]["properties"];
    let conditions = &schema["status"]["properties"]["conditions"];
    assert_eq!(conditions["x-kubernetes-list-type"].as_str(), Some("map"));
    assert_eq!(conditions["x-kubernetes-list-map-keys"][0].as_str(), Some("type"));
    let transfer = &schema["spec"]["properties"]["transfer"]["properties"];
    assert_eq!(transfer["checksum"]["enum"].as_sequence().map(Vec::len), Some(3));
    assert_eq!(transfer["checksum"]["default"].as_str(), Some("Disabled"));
    assert_eq!(transfer["mode"]["default"].as_str(), Some("Push"));
    let require = &transfer["requirePath"];
    assert_eq!(require["maxItems"].as_u64(), Some(8));
    let kinds: Vec<&str> = require["items"]["enum"]
        .as_sequence()
        .expect("requirePath's kinds")
        .iter()
        .filter_map(|k| k.as_str())
        .collect();
    assert_eq!(kinds, ["Rdma", "SharedMemory", "Local", "CudaIpc", "Tcp", "Other"]);
}

#[test]
fn every_schema_property_has_a_description() {
    fn walk(path: &str, node: &serde_yaml::Value, missing: &mut Vec<String>) {
        if let Some(props) = node.get("properties").and_then(serde_yaml::Value::as_mapping) {
            for (key, child) in props {
                let key = key.as_str().unwrap_or("?");
                let here = format!("{path}.{key}");
                // metadata comes from Kubernetes; status fields with hand-written schemas too.
                if child.get("description").is_none() && here != ".metadata" && here != ".apiVersion" && here != ".kind"
                {
                    missing.push(here.clone());
                }
                walk(&here, child, missing);
            }
        }
        if let Some(items) = node.get("items") {
            walk(&format!("{path}[]"), items, missing);
        }
    }
    let crd: serde_yaml::Value = serde_yaml::from_str(&pdpair_operator::crd::all()[0].yaml).expect("CRD YAML parses");
    let mut missing = Vec::new();
    walk(
        "",
        &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
        &mut missing,
    );
    assert!(missing.is_empty(), "fields without a description: {missing:?}");
}
